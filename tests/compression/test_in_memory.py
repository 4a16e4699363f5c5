"""qpalette.quantize: a loaded model quantized in memory equals compress + load, to the bit."""

import pytest
import torch
from helpers import run_compress
from tiny_llama import make_tiny_llama

import qpalette
from qpalette.errors import QpaletteError
from qpalette.runtime.loading import load_model


@pytest.mark.parametrize("scheme,lm_head,tied", [("nuq-4", False, False), ("vq-3.0", True, True)])
def test_in_memory_equals_compress_then_load(tmp_path, scheme, lm_head, tied):
    src = make_tiny_llama(tmp_path / "src", vocab_size=272, tie_word_embeddings=tied)  # 272 rows tile
    run_compress(src, tmp_path / "q", scheme=scheme, lm_head=lm_head)
    loaded, _ = load_model(tmp_path / "q", "cpu")
    model, _ = load_model(src, "cpu")
    assert qpalette.quantize(model, scheme, lm_head=lm_head, device="cpu") is model  # in place
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(QpaletteError, match="already quantized"):
        qpalette.quantize(model, scheme)


def test_in_memory_with_hessians_equals_compress_hessians_then_load(tmp_path):
    """Data-aware (LDLQ) in memory: the same tensors, logits and quantization_config as
    `compress --hessians` then load."""
    src = make_tiny_llama(tmp_path / "src", vocab_size=272)
    (tmp_path / "calib.txt").write_text("the weights of each layer round to codes on this text " * 40)
    qpalette.hessians(str(src), tmp_path / "h", text_file=str(tmp_path / "calib.txt"), tokens=512, seq_len=64,
                      device="cpu", progress=False)
    qpalette.compress(str(src), "nuq-3", tmp_path / "q", lm_head=True, hessians=tmp_path / "h", damp=0.02,
                      device="cpu", quiet=True)
    loaded, _ = load_model(tmp_path / "q", "cpu")
    model, _ = load_model(src, "cpu")
    qpalette.quantize(model, "nuq-3", qpalette.CompressConfig(lm_head=True, damp=0.02), hessians=tmp_path / "h",
                      device="cpu")
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert model.config.quantization_config == loaded.config.quantization_config.to_dict()
    plain, _ = load_model(src, "cpu")
    qpalette.quantize(plain, "nuq-3", lm_head=True, device="cpu")
    codes = "model.layers.0.mlp.down_proj.codes"
    assert not torch.equal(plain.state_dict()[codes], mine[codes])  # the Hessians changed the rounding


def test_bad_requests(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, "cpu")
    with pytest.raises(QpaletteError, match="unknown"):
        qpalette.quantize(model, "nuq-17")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(QpaletteError, match="NaN"):
        qpalette.quantize(model, "nuq-4")


def test_random_codes_in_memory_equal_compress_random_codes(tmp_path):
    """The speed-measurement models (`qpalette profile`'s anchor): in memory, the same random codes
    as `compress --random-codes` then load; with Hessians, refused."""
    from qpalette.compression.in_memory import quantize_model
    from qpalette.config import CompressConfig

    src = make_tiny_llama(tmp_path / "src", vocab_size=272)
    qpalette.compress(str(src), "tcq-2.0", tmp_path / "q", lm_head=True, device="cpu", quiet=True, random_codes=True)
    loaded, _ = load_model(tmp_path / "q", "cpu")
    model, _ = load_model(src, "cpu")
    quantize_model(model, None, CompressConfig(scheme="tcq-2.0", lm_head=True), device="cpu", random_codes=True)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    plain, _ = load_model(src, "cpu")
    quantize_model(plain, None, CompressConfig(scheme="tcq-2.0", lm_head=True), device="cpu")
    codes = "model.layers.0.mlp.down_proj.codes"
    assert not torch.equal(plain.state_dict()[codes], mine[codes])
    with pytest.raises(QpaletteError, match="random codes"):
        quantize_model(load_model(src, "cpu")[0], None, CompressConfig(scheme="tcq-2.0"), hessians=tmp_path,
                       random_codes=True)
