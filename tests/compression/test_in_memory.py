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


def test_bad_requests(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, "cpu")
    with pytest.raises(QpaletteError, match="unknown"):
        qpalette.quantize(model, "nuq-17")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(QpaletteError, match="NaN"):
        qpalette.quantize(model, "nuq-4")
