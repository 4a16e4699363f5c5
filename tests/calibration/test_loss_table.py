"""`qpalette loss-table`: measured Δloss per (layer, entry) on the trained tiny model; resume; errors."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from typer.testing import CliRunner

import qpalette.calibration.loss_table as lt
from qpalette.calibration.evaluator import BlockEvaluator
from qpalette.calibration.loss_table import LossTableOptions, build_loss_table
from qpalette.cli import app

ENTRIES = ["nuq-2", "vq-2.0", "nuq-4", "vq-3.0"]


def _opts(model_dir, text, out, **kw):
    base = dict(model=str(model_dir), output=out, text_file=str(text), entries=ENTRIES, tokens=4 * 128,
                seq_len=128, device="cpu", progress=False)
    return LossTableOptions(**(base | kw))


@pytest.fixture(scope="module")
def table(trained_tiny_llama_dir, tmp_path_factory):
    model_dir, text = trained_tiny_llama_dir
    out = tmp_path_factory.mktemp("lt") / "table.json"
    return build_loss_table(_opts(model_dir, text, out), log=lambda m: None), out


def test_cells_finite_and_coarser_entries_cost_more(table):
    doc, out = table
    assert json.loads(out.read_text()) == doc and doc["format"] == "qpalette.loss_table/1"
    blocks = [n for n in doc["shapes"] if n != "lm_head"]
    assert sorted(doc["rows"]) == sorted(blocks)  # lm_head (257 rows) fits no entry: no row
    assert all(math.isfinite(v) for r in doc["rows"].values() for v in r.values())
    assert all(set(r) == set(ENTRIES) for r in doc["rows"].values())
    mean = {q: statistics.fmean(r[q] for r in doc["rows"].values()) for q in ENTRIES}
    assert mean["nuq-2"] > mean["nuq-4"] > 0 and mean["vq-2.0"] > mean["vq-3.0"] > 0
    assert doc["base"] is None and doc["rounding"] == "nearest" and doc["tokens"] == 512


def test_cell_is_the_full_models_loss_increase(table, trained_tiny_llama_dir):
    """A cell equals the CE of the whole model (plain forward) with that layer's weight replaced by
    what compress would store for it, minus the unquantized model's CE."""
    import torch

    from qpalette.calibration.data import text_windows
    from qpalette.compression.blocks import quantized_weight
    from qpalette.quant.incoherence import random_signs
    from qpalette.runtime.checkpoint import sign_seed
    from qpalette.runtime.loading import load_model

    doc, _ = table
    model_dir, text = trained_tiny_llama_dir
    model, tok = load_model(model_dir, "cpu", torch.float32)
    ids = text_windows(tok, text.read_text(encoding="utf-8", errors="replace"), 4, 128)
    with torch.no_grad():
        base = float(model(input_ids=ids, labels=ids).loss)
        mod = model.get_submodule("model.layers.1.mlp.up_proj")
        mod.weight.copy_(quantized_weight(mod.weight, "vq-2.0", random_signs(64, sign_seed(0, 1, "gateup")), "cpu"))
        got = float(model(input_ids=ids, labels=ids).loss) - base
    assert doc["base_loss"] == pytest.approx(base, rel=1e-5)
    assert doc["rows"]["model.layers.1.mlp.up_proj"]["vq-2.0"] == pytest.approx(got, rel=1e-3, abs=1e-6)


def test_interrupted_run_resumes_to_the_same_table(table, trained_tiny_llama_dir, tmp_path, monkeypatch):
    doc, _ = table
    model_dir, text = trained_tiny_llama_dir
    out = tmp_path / "t.json"
    real, calls = BlockEvaluator.mean_nll, {"n": 0}

    def stop_after_20(self):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(BlockEvaluator, "mean_nll", stop_after_20)
        with pytest.raises(KeyboardInterrupt):
            build_loss_table(_opts(model_dir, text, out), log=lambda m: None)
    partial = json.loads((tmp_path / "t.json.partial.json").read_text())
    assert sum(len(r) for r in partial["rows"].values()) == 19  # the baseline pass was the first call
    with pytest.raises(Exception, match="pass --resume"):
        build_loss_table(_opts(model_dir, text, out), log=lambda m: None)
    again = build_loss_table(_opts(model_dir, text, out, resume=True), log=lambda m: None)
    assert again["timing"]["cells_measured"] == len(ENTRIES) * 14 - 19
    strip = lambda d: {k: v for k, v in d.items() if k != "timing"}  # noqa: E731
    assert strip(again) == strip(doc)  # bit-identical cells
    assert not (tmp_path / "t.json.partial.json").exists()


def test_base_entry_and_ldlq(trained_tiny_llama_dir, tmp_path):
    model_dir, text = trained_tiny_llama_dir
    hess = tmp_path / "hess"
    from qpalette.calibration.hessians import HessianOptions, collect_hessians

    collect_hessians(HessianOptions(str(model_dir), hess, text_file=str(text), tokens=512, seq_len=128,
                                    device="cpu", progress=False), log=lambda m: None)
    plain = build_loss_table(_opts(model_dir, text, tmp_path / "a.json", layers=r"layers\.1\.mlp\.down",
                                   entries=["nuq-2"]), log=lambda m: None)
    on_base = build_loss_table(_opts(model_dir, text, tmp_path / "b.json", layers=r"layers\.1\.mlp\.down",
                                     entries=["nuq-2"], base="nuq-3", hessians=str(hess)), log=lambda m: None)
    assert on_base["base"] == "nuq-3" and on_base["rounding"] == "ldlq"
    assert on_base["base_loss"] > plain["base_loss"]  # every block layer at 3 bits
    assert list(on_base["rows"]) == ["model.layers.1.mlp.down_proj"]
    assert math.isfinite(on_base["rows"]["model.layers.1.mlp.down_proj"]["nuq-2"])
    with pytest.raises(Exception, match="other settings"):  # resume refuses another baseline
        build_loss_table(_opts(model_dir, text, tmp_path / "b.json", layers=r"layers\.1\.mlp\.down",
                               entries=["nuq-2"], resume=True), log=lambda m: None)


@pytest.mark.parametrize("extra, message", [
    ([], "--text-file FILE or --dataset"),
    (["--text-file", "TEXT", "--device", "cpu,cpu"], "one device"),
    (["--text-file", "TEXT", "--entries", "nuq-9"], "unknown"),
    (["--text-file", "TEXT", "--layers", "nothing"], "matches no linear layer"),
    (["--text-file", "TEXT", "--base", "vq-9"], "unknown"),
])
def test_cli_user_errors_are_one_line(tiny_llama_dir, trained_tiny_llama_dir, tmp_path, extra, message):
    text = str(trained_tiny_llama_dir[1])
    args = ["loss-table", str(tiny_llama_dir), "-o", str(tmp_path / "t.json"), "-q"]
    r = CliRunner().invoke(app, args + [text if a == "TEXT" else a for a in extra])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_cli_writes_the_table(trained_tiny_llama_dir, tmp_path):
    model_dir, text = trained_tiny_llama_dir
    out = tmp_path / "t.json"
    r = CliRunner().invoke(app, ["loss-table", str(model_dir), "--text-file", str(text), "-o", str(out), "-q",
                                 "--entries", "nuq-3", "--tokens", "256", "--seq-len", "128",
                                 "--layers", r"layers\.0\.self_attn\.q", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert list(json.loads(out.read_text())["rows"]) == ["model.layers.0.self_attn.q_proj"]
    assert lt.PARTIAL_FORMAT not in out.read_text()


def test_windows_cut_at_block_boundaries():
    from qpalette.models.topology import LayerShape

    layers = [LayerShape(f"model.layers.{b}.mlp.{k}_proj", 16, 16, b, k) for b in range(3) for k in ("gate", "up")]
    cells = [(l, q) for l in layers for q in ("nuq-2", "nuq-3")]  # 4 cells of 1 KiB a block
    assert [len(w) for w in lt._windows(cells, 1 << 30)] == [12]
    assert [len(w) for w in lt._windows(cells, 8 * 1024)] == [8, 4]
    assert [len(w) for w in lt._windows(cells, 1)] == [4, 4, 4]  # never less than a block
    assert [c for w in lt._windows(cells, 1) for c in w] == cells


def test_ldlq_cells_are_the_models_loss_with_compress_weights(trained_tiny_llama_dir, tmp_path, monkeypatch):
    """With Hessians, cells quantized together in one window (o_proj and up_proj: one column
    count, two Hessians) equal the full model's loss increase with each layer's LDLQ weight made
    alone (`quantized_weight` with its own Hessian)."""
    import torch

    from qpalette.calibration.data import text_windows
    from qpalette.calibration.hessian_files import HessianSet
    from qpalette.calibration.hessians import HessianOptions, collect_hessians
    from qpalette.compression.blocks import quantized_weight
    from qpalette.quant.incoherence import random_signs
    from qpalette.runtime.checkpoint import sign_seed
    from qpalette.runtime.loading import load_model

    model_dir, text = trained_tiny_llama_dir
    hess = tmp_path / "hess"
    collect_hessians(HessianOptions(str(model_dir), hess, text_file=str(text), tokens=512, seq_len=128,
                                    device="cpu", progress=False), log=lambda m: None)
    monkeypatch.setattr(lt, "_window_bytes", lambda device: 1)  # one block a window
    doc = build_loss_table(_opts(model_dir, text, tmp_path / "t.json", layers=r"(mlp\.up|self_attn\.o)", entries=["vq-2.0"],
                                 hessians=str(hess)), log=lambda m: None)
    model, tok = load_model(model_dir, "cpu", torch.float32)
    ids = text_windows(tok, text.read_text(encoding="utf-8", errors="replace"), 4, 128)
    h = HessianSet(hess).load(1)
    with torch.no_grad():
        base = float(model(input_ids=ids, labels=ids).loss)
        for name, group in (("mlp.up_proj", "gateup"), ("self_attn.o_proj", "o")):
            mod = model.get_submodule(f"model.layers.1.{name}")
            saved = mod.weight.clone()
            signs = random_signs(mod.in_features, sign_seed(0, 1, group))
            mod.weight.copy_(quantized_weight(mod.weight, "vq-2.0", signs, "cpu", h[group]))
            got = float(model(input_ids=ids, labels=ids).loss) - base
            mod.weight.copy_(saved)
            assert doc["rows"][f"model.layers.1.{name}"]["vq-2.0"] == pytest.approx(got, rel=1e-3, abs=1e-6)
