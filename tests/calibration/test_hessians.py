"""`qpalette hessians`: block-streamed XᵀX/n equals the full model's, the file schema, resume,
and user mistakes as one-line errors."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from qpalette.calibration import hessians as hessians_mod
from qpalette.calibration.hessians import HessianOptions, collect_hessians
from qpalette.cli import app
from qpalette.errors import InputError

runner = CliRunner()
SEQ, TOKENS = 64, 1024  # 16 windows


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    words = ["the", "model", "weights", "quantized", "layer", "of", "a", "tile", "rounds", "text"]
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (800,), generator=g))
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(text)
    return path


def collect(model_dir, out, text_file, **kw):
    kw = {"tokens": TOKENS, "seq_len": SEQ, "batch_size": 3, "device": "cpu", "progress": False, **kw}
    opts = HessianOptions(model=str(model_dir), output=out, text_file=str(text_file), **kw)
    return collect_hessians(opts, log=lambda m: None)


def reference_hessians(model_dir, text_file) -> dict[str, torch.Tensor]:
    """XᵀX/n (float64) of q_proj, o_proj, gate_proj, down_proj and lm_head inputs, hooked on the
    whole Hugging Face model run on the same windows in one pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpalette.calibration.data import text_windows

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = text_windows(tokenizer, text_file.read_text(), TOKENS // SEQ, SEQ)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sums = {}

    def hook(name):
        def add(_mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
        return add

    for name, mod in model.named_modules():
        if name.endswith(("q_proj", "o_proj", "gate_proj", "down_proj")) or name == "lm_head":
            mod.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(ids)
    return {k: v / ids.numel() for k, v in sums.items()}


def test_hessians_equal_the_full_model_forward(tiny_llama_dir, text_file, tmp_path):
    man = collect(tiny_llama_dir, tmp_path / "h", text_file)
    ref = reference_hessians(tiny_llama_dir, text_file)
    modules = {"qkv": "self_attn.q_proj", "o": "self_attn.o_proj", "gateup": "mlp.gate_proj",
               "down": "mlp.down_proj"}
    assert sorted(man["files"]) == ["block-00000.safetensors", "block-00001.safetensors", "head.safetensors"]
    for block in range(2):
        got = load_file(str(tmp_path / "h" / f"block-{block:05d}.safetensors"))
        assert sorted(got) == sorted(modules)
        for group, module in modules.items():
            want = ref[f"model.layers.{block}.{module}"]
            assert got[group].dtype == torch.float32
            assert (got[group].double() - want).abs().max() < 1e-5 * want.abs().max(), (block, group)
    head = load_file(str(tmp_path / "h" / "head.safetensors"))["head"].double()
    assert (head - ref["lm_head"]).abs().max() < 1e-5 * ref["lm_head"].abs().max()
    # the schema: manifest, per-file headers, per-group token counts
    assert man["format"] == "qpalette.hessians/1" and man["tokens"] == TOKENS and man["seq_len"] == SEQ
    assert man["text_sha256"] == hashlib.sha256(text_file.read_text().encode()).hexdigest()
    assert man["model"] == str(tiny_llama_dir) and man["blocks"] == 2
    qkv = man["files"]["block-00001.safetensors"]["groups"]["qkv"]
    assert qkv == {"layers": [f"model.layers.1.self_attn.{k}_proj" for k in "qkv"], "in_features": 64,
                   "tokens": TOKENS}
    with safe_open(str(tmp_path / "h" / "block-00001.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["qpalette.hessians"])
    assert header["format"] == "qpalette.hessians/1" and header["block"] == 1
    assert header["groups"]["qkv"] == qkv
    assert header["run"]["text_sha256"] == man["text_sha256"] and header["tokens"] == TOKENS
    assert header["model"] == str(tiny_llama_dir) and header["run"]["seq_len"] == SEQ
    for name, entry in man["files"].items():
        assert hashlib.sha256((tmp_path / "h" / name).read_bytes()).hexdigest() == entry["sha256"]


class Killed(BaseException):
    """What a kill looks like to the run: it stops where it is."""


def test_resume_skips_finished_blocks_and_gives_identical_files(tiny_llama_dir, text_file, tmp_path,
                                                               monkeypatch):
    collect(tiny_llama_dir, tmp_path / "whole", text_file)
    real, written = hessians_mod.write_file, []

    def killed_after_block_0(path, hs, header):
        if header["block"] == 1:
            raise Killed
        written.append(header["block"])
        return real(path, hs, header)

    with monkeypatch.context() as m:
        m.setattr(hessians_mod, "write_file", killed_after_block_0)
        with pytest.raises(Killed):
            collect(tiny_llama_dir, tmp_path / "killed", text_file)
    first = tmp_path / "killed" / "block-00000.safetensors"
    assert written == [0] and first.is_file() and not (tmp_path / "killed" / "hessians.json").exists()
    stamp = first.stat().st_mtime_ns
    (tmp_path / "killed" / ".block-00001.safetensors.x.tmp").write_bytes(b"half-written")
    with pytest.raises(InputError, match="--resume"):
        collect(tiny_llama_dir, tmp_path / "killed", text_file)
    with pytest.raises(InputError, match="other settings"):
        collect(tiny_llama_dir, tmp_path / "killed", text_file, resume=True, tokens=TOKENS // 2)
    written.clear()
    with monkeypatch.context() as m:
        m.setattr(hessians_mod, "write_file", lambda *a: written.append(a[2]["block"]) or real(*a))
        man = collect(tiny_llama_dir, tmp_path / "killed", text_file, resume=True)
    assert written == [1, 2] and first.stat().st_mtime_ns == stamp and man["resumed"]
    assert not list((tmp_path / "killed").glob(".*.tmp"))
    for name in ("block-00000.safetensors", "block-00001.safetensors", "head.safetensors"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes(), name


def test_cli_errors_are_one_line(tiny_llama_dir, text_file, tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    base = ["hessians", str(tiny_llama_dir), "-o", str(tmp_path / "a")]
    cases = [
        (base, "--text-file FILE or --dataset"),
        ([*base, "--text-file", str(tmp_path / "no.txt")], "no such file"),
        ([*base, "--text-file", str(text_file), "--seq-len", "4096"], "longer than the model's context"),
        ([*base, "--text-file", str(tmp_path / "short.txt")], "fewer than one window"),
        (["hessians", "/no/such/model", "-o", str(tmp_path / "a"), "--text-file", str(text_file)], "no such"),
    ]
    for args, msg in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], (args, res.output)
    assert not (tmp_path / "a").exists()
