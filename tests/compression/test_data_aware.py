"""`compress --hessians`: data-aware LDLQ checkpoints load and run, lower each layer's proxy loss,
record what they used, resume, and refuse Hessians of another model."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compress_killed_at_second_shard, run_compress
from safetensors.torch import load_file
from tiny_llama import make_tiny_llama
from typer.testing import CliRunner

import qpalette
from qpalette.calibration.hessians import HessianOptions, collect_hessians
from qpalette.cli import app
from qpalette.errors import CompressError
from qpalette.quant.ldlq import proxy_loss
from qpalette.runtime.checkpoint import simulated_weights

runner = CliRunner()


@pytest.fixture(scope="module")
def model_and_hessians(tmp_path_factory):
    """The tiny Llama with a 272-token vocabulary (lm_head tileable) and its Hessians on a text."""
    root = tmp_path_factory.mktemp("data_aware")
    src = make_tiny_llama(root / "src", vocab_size=272)
    g = torch.Generator().manual_seed(0)
    (root / "calib.txt").write_text(" ".join(
        ["weights", "of", "each", "layer", "round", "to", "codes", "text"][int(i)]
        for i in torch.randint(0, 8, (600,), generator=g)))
    opts = HessianOptions(model=str(src), output=root / "h", text_file=str(root / "calib.txt"), tokens=1024,
                          seq_len=64, device="cpu", progress=False)
    collect_hessians(opts, log=lambda m: None)
    return src, root / "h"


def layer_losses(out, hessian_dir) -> dict[str, float]:
    """tr((W − Ŵ) H (W − Ŵ)ᵀ) of every quantized layer of a checkpoint, H from the Hessian files."""
    from transformers import AutoModelForCausalLM

    from qpalette.models.topology import INPUT_GROUPS, parse_layer_name

    src = AutoModelForCausalLM.from_pretrained(str(out.parent / "src"), dtype=torch.float32)
    model = qpalette.from_pretrained(out, device="cpu")
    losses = {}
    for name, w_hat in simulated_weights(model, model.config.quantization_config.layout()).items():
        block, kind = parse_layer_name(name, 2)
        file = "head.safetensors" if kind == "head" else f"block-{block:05d}.safetensors"
        h = load_file(str(hessian_dir / file))[INPUT_GROUPS[kind]]
        losses[name] = proxy_loss(src.get_submodule(name).weight.detach(), w_hat, h)
    return losses


def test_data_aware_checkpoint_runs_and_lowers_every_layers_loss(model_and_hessians):
    src, hessians = model_and_hessians
    out = src.parent
    rep = run_compress(src, out / "aware", scheme="nuq-3", lm_head=True, hessians=hessians)
    run_compress(src, out / "free", scheme="nuq-3", lm_head=True)
    model = qpalette.from_pretrained(out / "aware", device="cpu")
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))).logits
    assert logits.shape == (2, 24, 272) and bool(torch.isfinite(logits).all())
    manifest = json.loads((hessians / "hessians.json").read_text())
    recorded = json.loads((out / "aware" / "config.json").read_text())["quantization_config"]["data_aware"]
    assert recorded == rep["data_aware"]
    assert recorded["method"] == "ldlq" and recorded["damp"] == 0.01
    assert recorded["hessians"]["tokens"] == manifest["tokens"] == 1024
    assert recorded["hessians"]["text_sha256"] == manifest["text_sha256"]
    assert "data-aware LDLQ" in (out / "aware" / "README.md").read_text()
    assert "data_aware" not in json.loads((out / "free" / "config.json").read_text())["quantization_config"]
    aware, free = layer_losses(out / "aware", hessians), layer_losses(out / "free", hessians)
    assert len(aware) == 15  # 7 layers × 2 blocks + lm_head
    for name in aware:
        assert aware[name] < 0.9 * free[name], (name, aware[name], free[name])



def test_stored_codes_are_each_matrixs_own_ldlq(model_and_hessians, tmp_path):
    """Matrices of one entry and one column count are coded together (qkv, o and gate_up here):
    each stored matrix still equals `quantize_matrix` of that matrix alone with its own Hessian."""
    from qpalette.compression.blocks import quantize_matrix
    from qpalette.quant.incoherence import random_signs
    from qpalette.runtime.checkpoint import sign_seed

    src, hessians = model_and_hessians
    run_compress(src, tmp_path / "q", scheme="vq-2.0", hessians=hessians)
    stored = {}
    for f in (tmp_path / "q").glob("*.safetensors"):
        stored.update(load_file(str(f)))
    weights = {}
    for f in src.glob("*.safetensors"):
        weights.update(load_file(str(f)))
    h = load_file(str(hessians / "block-00001.safetensors"))
    pre = "model.layers.1."
    for module, members, group in (("self_attn.qkv_proj", ("q", "k", "v"), "qkv"), ("self_attn.o_proj", ("o",), "o"),
                                   ("mlp.gate_up_proj", ("gate", "up"), "gateup"), ("mlp.down_proj", ("down",), "down")):
        part = "self_attn" if group in ("qkv", "o") else "mlp"
        w = torch.cat([weights[f"{pre}{part}.{m}_proj.weight"].float() for m in members])
        signs = random_signs(w.shape[1], sign_seed(0, 1, group))
        want = quantize_matrix(w, "vq-2.0", signs, "cpu", h[group])
        for k, v in want.items():
            assert torch.equal(stored[f"{pre}{module}.{k}"], v), (module, k)


def test_window_of_blocks_changes_no_byte(model_and_hessians, tmp_path, monkeypatch):
    """Both blocks coded together (the default window) or one at a time: identical shards."""
    from qpalette.compression import writer

    src, hessians = model_and_hessians
    real, windows = writer.code_blocks, []
    monkeypatch.setattr(writer, "code_blocks", lambda s, h, *a: windows.append(sorted(h)) or real(s, h, *a))
    run_compress(src, tmp_path / "together", scheme="tcq-2.0", hessians=hessians)
    monkeypatch.setattr(writer, "CPU_WINDOW_BYTES", 1)
    run_compress(src, tmp_path / "apart", scheme="tcq-2.0", hessians=hessians)
    assert windows == [[0, 1], [0], [1]]
    shards = sorted(p.name for p in (tmp_path / "together").glob("*.safetensors"))
    assert len(shards) == 3
    for s in shards:
        assert (tmp_path / "together" / s).read_bytes() == (tmp_path / "apart" / s).read_bytes()


def test_resume_with_hessians_gives_identical_shards(model_and_hessians, tmp_path, monkeypatch):
    src, hessians = model_and_hessians
    run_compress(src, tmp_path / "whole", scheme="vq-2.0", hessians=hessians)
    compress_killed_at_second_shard(src, tmp_path / "killed", monkeypatch, scheme="vq-2.0", hessians=hessians)
    with pytest.raises(CompressError, match="other settings"):
        run_compress(src, tmp_path / "killed", scheme="vq-2.0", hessians=hessians, damp=0.1, resume=True)
    with pytest.raises(CompressError, match="other settings"):
        run_compress(src, tmp_path / "killed", scheme="vq-2.0", resume=True)  # data-free now
    rep = run_compress(src, tmp_path / "killed", scheme="vq-2.0", hessians=hessians, resume=True)
    assert rep["resumed"] and rep["data_aware"]["method"] == "ldlq"
    shards = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert len(shards) == 3
    for s in shards:
        assert (tmp_path / "whole" / s).read_bytes() == (tmp_path / "killed" / s).read_bytes()


def test_cli_refuses_hessians_that_do_not_fit(model_and_hessians, tmp_path):
    src, hessians = model_and_hessians
    other = make_tiny_llama(tmp_path / "other", vocab_size=272, seed=1)  # same shapes, other weights
    deeper = make_tiny_llama(tmp_path / "deeper", vocab_size=272, num_hidden_layers=3)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in hessians.iterdir():
        data = f.read_bytes()
        (damaged / f.name).write_bytes(data[:-8] + b"\x00" * 8 if f.name.startswith("block-00001") else data)
    cases = [
        ([str(other), "--hessians", str(hessians)], "collected on another model"),
        ([str(deeper), "--hessians", str(hessians)], "collected on another model"),
        ([str(src), "--hessians", str(unfinished)], "not a finished `qpalette hessians` run"),
        ([str(src), "--hessians", str(tmp_path / "nope")], "no such folder"),
        ([str(src), "--hessians", str(damaged)], "block-00001.safetensors is damaged"),
        ([str(src), "--damp", "0.1"], "--damp goes with --hessians"),
        ([str(src), "--hessians", str(hessians), "--damp", "-1"], "must be ≥ 0"),
    ]
    for i, (args, msg) in enumerate(cases):
        out = str(tmp_path / f"q{i}")
        res = runner.invoke(app, ["compress", *args, "--scheme", "nuq-3", "-o", out, "-q"])
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], (args, res.output)
