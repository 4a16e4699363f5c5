"""`qpalette calibrate`: the fit, the block cache, exact restore, resume, data-aware path, CLI."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import spearman
from shared_data import shared_dir
from typer.testing import CliRunner

import qpalette.calibration.noise as cal
from qpalette.calibration.evaluator import BlockEvaluator, linear_layers
from qpalette.calibration.noise import (
    Settings,
    fit_through_origin,
    layer_deltas,
    noise_direction,
    noise_levels,
)
from qpalette.calibration.sensitivity import CalibrateOptions, calibrate, parse_devices
from qpalette.cli import app
from qpalette.errors import CalibrationError, InputError
from qpalette.runtime.loading import load_model

WIKITEXT = shared_dir() / "data" / "wikitext2_raw_test.txt"
ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- the fit


def test_fit_recovers_known_a_and_r2():
    rng = random.Random(0)
    t = noise_levels(16)
    assert t[0] == pytest.approx(1 / 16) and t[-1] == 1.0 and len(t) == 16
    a_true = 0.37
    y = [a_true * ti**2 * (1 + 0.02 * rng.gauss(0, 1)) for ti in t]
    a, r2 = fit_through_origin(t, y)
    assert a == pytest.approx(a_true, rel=0.02)
    assert r2 > 0.99
    a, r2 = fit_through_origin(t, [a_true * ti**2 for ti in t])
    assert a == pytest.approx(a_true, rel=1e-12) and r2 == pytest.approx(1.0, abs=1e-12)
    # a response that is not quadratic in t (∝ t) fits badly: R² tells
    _a, r2_lin = fit_through_origin(t, [ti for ti in t])
    assert r2_lin < 0.95


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_auto_dtype_is_bfloat16_on_gpus_and_float32_on_cpu(monkeypatch):
    """--dtype auto: bfloat16 blocks on a GPU (measured to move a_l far less than the seed does),
    float32 on the CPU; the TF32 switch is left alone."""
    from qpalette.calibration.sensitivity import AUTO_CUDA_DTYPE
    from qpalette.devices import resolve_dtype

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert resolve_dtype("auto", torch.device("cuda:0"), auto_cuda=AUTO_CUDA_DTYPE) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), auto_cuda=AUTO_CUDA_DTYPE) is torch.float32
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_parse_devices():
    assert parse_devices("cpu") == ["cpu"] and parse_devices("cpu, cpu") == ["cpu", "cpu"]
    if not torch.cuda.is_available():
        assert parse_devices("auto") == ["cpu"]
    with pytest.raises(InputError, match="bad --device"):
        parse_devices("tpu")


# --------------------------------------------------------------------------- the engine


def _tokens(vocab, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def _directional_fisher_a(model, tokens, name, direction):
    """½‖W‖²·ε̂ᵀFε̂ (mean over tokens): the exact small-noise ΔKL/t² along ε̂ (second order).

    d = ∂logits/∂s along W + s·‖W‖·ε̂ by a float64 central difference; the Fisher quadratic
    form of a softmax is Var_p(d)."""
    w = dict(model.named_parameters())[name + ".weight"]
    w0 = w.detach().clone()
    step = direction.to(w.dtype) * torch.linalg.vector_norm(w0)
    h = 1e-5
    with torch.no_grad():
        w.copy_(w0 + h * step)
        up = model(tokens).logits
        w.copy_(w0 - h * step)
        down = model(tokens).logits
        w.copy_(w0)
        p = torch.softmax(model(tokens).logits, dim=-1)
    d = (up - down) / (2 * h)
    var = (p * d * d).sum(-1) - (p * d).sum(-1) ** 2
    return 0.5 * float(var.mean())


def test_known_a_matches_second_order_theory(tiny_llama_dir, device):
    """Small noise: a_l must equal ½‖W‖²·ε̂ᵀFε̂, computed exactly with a forward-mode JVP."""
    model, _ = load_model(tiny_llama_dir, device, torch.float64)
    tokens = _tokens(model.config.vocab_size, 2, 16)
    st = Settings(seed=3, levels=4, t_max=0.01, batch_size=2, dtype="float32")
    got = {n: fit_through_origin(noise_levels(4, 0.01), d)
           for n, d, _s in layer_deltas(model, tokens, [n for n, _m, _b in linear_layers(model)], st, device)}
    assert len(got) == 15 and "lm_head" in got  # 2 blocks × 7 layers, and the head
    for k, (name, _m, _b) in enumerate(linear_layers(model)):
        eps = noise_direction(_m.weight.shape, 3, k, 0, device)
        expected = _directional_fisher_a(model, tokens.to(device), name, eps)
        a, r2 = got[name]
        assert a == pytest.approx(expected, rel=0.03), name
        assert r2 > 0.999, name
    a_vals = [v[0] for v in got.values()]
    assert max(a_vals) / min(a_vals) > 2  # the layers really differ: not a constant


def test_block_cache_equals_full_forward_and_restore_is_exact(tiny_llama_dir, device):
    model, _ = load_model(tiny_llama_dir, device, torch.float32)
    tokens = _tokens(model.config.vocab_size, 5, 16, seed=1)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ev = BlockEvaluator(model, tokens, 2, device, cache_ref_bytes=1 << 30)
    ev.prepare()
    assert ev.mean_kl() == 0.0  # unperturbed: exactly zero
    with torch.no_grad():
        ref = torch.log_softmax(model(tokens.to(device)).logits.double(), -1)
    ev.advance_to(1)
    w = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        w.add_(0.3 * torch.randn_like(w) * w.norm() / w.numel() ** 0.5)
    got = ev.mean_kl()
    with torch.no_grad():
        lp = torch.log_softmax(model(tokens.to(device)).logits.double(), -1)
    want = float((ref.exp() * (ref - lp)).sum(-1).mean())
    assert got > 1e-6
    assert got == pytest.approx(want, rel=1e-3)
    with torch.no_grad():
        w.copy_(before["model.layers.1.mlp.up_proj.weight"])
    names = [n for n, _m, _b in linear_layers(model)]
    for _ in layer_deltas(model, tokens, names, Settings(0, 16, 1.0, 2, "float32"), device):
        pass
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("where", ["block", "head"])
def test_reference_moments_equal_the_general_kl(tiny_llama_dir, where, monkeypatch):
    """The plain-head shortcut (per-token moments of the reference) against the general formula
    (reference log-probs cached, or recomputed from a saved head when they do not fit), a block
    layer or the head itself perturbed, fresh random perturbation."""
    from qpalette.calibration import evaluator

    model, _ = load_model(tiny_llama_dir, "cpu", torch.float32)
    tokens = _tokens(model.config.vocab_size, 5, 16, seed=2)
    w = model.model.layers[1].self_attn.o_proj.weight if where == "block" else model.lm_head.weight
    original = w.detach().clone()
    noise = 0.2 * torch.randn_like(w) * w.norm() / w.numel() ** 0.5
    got = {}
    for name, budget, plain in (("moments", 1 << 30, True), ("cached", 1 << 30, False), ("recomputed", 0, False)):
        if not plain:
            monkeypatch.setattr(evaluator, "plain_head_weight", lambda m: None)
        ev = evaluator.BlockEvaluator(model, tokens, 2, "cpu", cache_ref_bytes=budget)
        ev.prepare()
        assert (ev.moments is not None) == plain and (ev.ref_lp is None) == (name != "cached")
        ev.advance_to(1 if where == "block" else len(ev.blocks))
        with torch.no_grad():
            w.add_(noise)
        got[name] = ev.mean_kl()
        with torch.no_grad():
            w.copy_(original)
    assert got["cached"] > 1e-5
    assert got["moments"] == pytest.approx(got["cached"], rel=1e-4)
    assert got["recomputed"] == pytest.approx(got["cached"], rel=1e-6)


# --------------------------------------------------------------------------- the command


def _opts(model_dir, out, **kw):
    base = dict(model=str(model_dir), output=out, num_seqs=4, seq_len=32, levels=4, seed=0,
                devices=["cpu"], batch_size=2, progress=False)
    base.update(kw)
    return CalibrateOptions(**base)


def test_calibrate_output_schema(tiny_llama_dir, tmp_path, device):
    out = tmp_path / "sens.json"
    doc = calibrate(_opts(tiny_llama_dir, out, devices=[str(device)]), log=lambda m: None)
    disk = json.loads(out.read_text())
    assert disk["format"] == "qpalette.sensitivity/1" and disk == doc
    assert disk["protocol"] == "data-free" and disk["tokens"] == 4 * 32 and disk["levels"] == 4
    assert len(disk["layers"]) == 15  # 2 blocks × 7 and lm_head
    v = disk["layers"]["model.layers.0.self_attn.k_proj"]
    assert v["shape"] == [32, 64] and v["a"] > 0 and len(v["delta_kl"]) == 4 and v["r2"] <= 1
    assert disk["timing"]["total_s"] > 0 and disk["timing"]["evaluations"] == 15 * 4
    peak = disk["timing"]["peak_gpu_bytes"]  # torch's peak allocation, GPUs only
    assert peak is None if device.type == "cpu" else peak > 4 * 32 * 257 * 2
    assert not (tmp_path / "sens.json.partial.json").exists()


def test_resume_after_interruption(tiny_llama_dir, tmp_path, monkeypatch):
    full = calibrate(_opts(tiny_llama_dir, tmp_path / "full.json"), log=lambda m: None)
    out = tmp_path / "sens.json"
    real = cal.noise_direction
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 6:  # during the 6th layer (shared direction: one call per layer)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cal, "noise_direction", flaky)
    with pytest.raises(CalibrationError, match="--resume"):
        calibrate(_opts(tiny_llama_dir, out), log=lambda m: None)
    partial = json.loads((tmp_path / "sens.json.partial.json").read_text())
    assert len(partial["layers"]) == 5
    # the interrupted session's time is kept, to be added to the next session's
    before = partial["timing"]
    assert 0 < before["layers_s"] <= before["total_s"]
    # a new run without --resume refuses to clobber the unfinished one
    with pytest.raises(CalibrationError, match="unfinished"):
        calibrate(_opts(tiny_llama_dir, out), log=lambda m: None)
    # other settings cannot resume it
    with pytest.raises(CalibrationError, match="other settings"):
        calibrate(_opts(tiny_llama_dir, out, levels=5, resume=True), log=lambda m: None)
    calls["n"] = 0
    monkeypatch.setattr(cal, "noise_direction", lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), real(*a, **k))[1])
    doc = calibrate(_opts(tiny_llama_dir, out, resume=True), log=lambda m: None)
    assert calls["n"] == 15 - 5  # only the unfinished layers were measured again
    assert doc["timing"]["resumed"] is True
    assert doc["timing"]["layers_s"] > before["layers_s"] and doc["timing"]["total_s"] > before["total_s"]
    assert sum(v["seconds"] for v in doc["layers"].values()) <= doc["timing"]["layers_s"]
    for n, v in full["layers"].items():
        assert doc["layers"][n]["a"] == pytest.approx(v["a"], rel=1e-9), n
    assert not (tmp_path / "sens.json.partial.json").exists()


@pytest.mark.skipif(not WIKITEXT.is_file(), reason=f"{WIKITEXT} not present (set QPALETTE_SHARED)")
def test_data_aware_text_file(tiny_llama_dir, tmp_path):
    out = tmp_path / "sens.json"
    doc = calibrate(_opts(tiny_llama_dir, out, text_file=str(WIKITEXT), num_seqs=3, seq_len=48),
                    log=lambda m: None)
    assert doc["protocol"] == "data-aware" and doc["source"] == "file:wikitext2_raw_test.txt"
    assert doc["tokens"] == 3 * 48
    # the untrained model is no minimum of its CE on real text: a_l may have either sign there
    assert all(math.isfinite(v["a"]) and "delta_ce" in v for v in doc["layers"].values())
    kl = calibrate(_opts(tiny_llama_dir, tmp_path / "kl.json", text_file=str(WIKITEXT), num_seqs=3, seq_len=48,
                         loss="kl"), log=lambda m: None)
    assert all(v["a"] > 0 and math.isfinite(v["a"]) for v in kl["layers"].values())
    doc = kl
    free = calibrate(_opts(tiny_llama_dir, tmp_path / "free.json", num_seqs=3, seq_len=48),
                     log=lambda m: None)
    assert any(abs(doc["layers"][n]["a"] - free["layers"][n]["a"]) > 1e-6 * free["layers"][n]["a"]
               for n in doc["layers"])  # real text, not model samples


def test_text_shorter_than_a_window_is_a_clear_error(tiny_llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(InputError, match="fewer than one window"):
        calibrate(_opts(tiny_llama_dir, tmp_path / "s.json", text_file=str(short)), log=lambda m: None)


def _measured(doc: dict) -> dict:
    """The document less what depends on the run's timing and devices (exactly equal across runs)."""
    return {**{k: v for k, v in doc.items() if k != "timing"},
            "layers": {n: {k: x for k, x in v.items() if k != "seconds"} for n, v in doc["layers"].items()}}


def test_two_cpu_ranks_and_a_split_model_match_one_device(tiny_llama_dir, tmp_path):
    """Two processes with a copy each (torch.distributed, gloo), and one process with the model
    split over two devices (--max-memory below its 428 KB of weights), measure exactly what one
    device measures: the same operations on the same numbers in the same order (each rank's block
    cache advances through unperturbed, exactly restored blocks; the noise is seeded per layer)."""
    one = calibrate(_opts(tiny_llama_dir, tmp_path / "one.json"), log=lambda m: None)
    two = calibrate(_opts(tiny_llama_dir, tmp_path / "two.json", devices=["cpu", "cpu"]), log=lambda m: None)
    split = calibrate(_opts(tiny_llama_dir, tmp_path / "split.json", devices=["cpu", "cpu"], max_memory=300_000),
                      log=lambda m: None)
    assert one["timing"]["placement"] == "one device"
    for doc, placement in ((two, "replicas"), (split, "split")):
        assert doc["timing"]["placement"] == placement and doc["timing"]["devices"] == ["cpu", "cpu"]
        assert list(doc["layers"]) == list(one["layers"])
        assert _measured(doc) == _measured(one)
    assert json.loads((tmp_path / "two.json").read_text()) == two


def test_torchrun_gives_the_layers_of_one_process(tiny_llama_dir, tmp_path):
    out = tmp_path / "tr.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "qpalette", "calibrate", str(tiny_llama_dir), "-o", str(out), "-n", "4",
                          "--seq-len", "32", "--levels", "4", "--batch-size", "2", "--device", "cpu", "-q"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("15 layers") == 1  # rank 0 reports
    doc = json.loads(out.read_text())
    assert doc["timing"]["devices"] == ["cpu", "cpu"] and doc["timing"]["placement"] == "replicas"
    one = calibrate(_opts(tiny_llama_dir, tmp_path / "one.json"), log=lambda m: None)
    assert _measured(doc) == _measured(one)
    assert not list(tmp_path.glob("*.partial*")) and not list(tmp_path.glob("*.lock"))


def test_cli_runs_and_reports_errors(tiny_llama_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "s.json"
    r = runner.invoke(app, ["calibrate", str(tiny_llama_dir), "-o", str(out), "-n", "2", "--seq-len", "16",
                            "--levels", "3", "--layers", r"layers\.1\.mlp", "--device", "cpu", "-q"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(out.read_text())["layers"]) == 3
    cases = [
        (["--levels", "1"], "levels"),
        (["--layers", "nomatch_xyz"], "matches no linear layer"),
        (["--layers", "("], "regular expression"),
        (["--device", "tpu"], "bad --device"),
        (["--dtype", "int3"], "--dtype"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA GPU"))
    for extra, msg in cases:
        r = runner.invoke(app, ["calibrate", str(tiny_llama_dir), "-o", str(tmp_path / "x.json"), "-q", *extra])
        assert r.exit_code == 2, (extra, r.output)
        assert msg in r.output and "Traceback" not in r.output, (extra, r.output)
    r = runner.invoke(app, ["calibrate", str(tmp_path / "no_such_model"), "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = runner.invoke(app, ["calibrate", str(tiny_llama_dir), "--max-memory", "lots", "-q"])
    assert r.exit_code == 2 and "bad --max-memory" in r.output
    # a rank's user error (here rank 0's, in its own process) reaches the command as one line
    (tmp_path / "x.json.partial.json").write_text("{}")
    r = runner.invoke(app, ["calibrate", str(tiny_llama_dir), "-o", str(tmp_path / "x.json"), "--device", "cpu,cpu",
                            "-q"])
    assert r.exit_code == 2 and "an unfinished run exists" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_real_smollm2_cpu_reduced(smollm2_dir, tmp_path):
    """SmolLM2-135M on CPU, reduced: 2 blocks × 7 layers, 5 levels, 4×48 sampled tokens, 2 seeds."""
    docs = []
    for seed in (0, 1):
        docs.append(calibrate(_opts(smollm2_dir, tmp_path / f"s{seed}.json", num_seqs=4, seq_len=48,
                                    levels=5, seed=seed, batch_size=4,
                                    layers=r"layers\.(0|29)\."), log=lambda m: None))
    for d in docs:
        assert len(d["layers"]) == 14
        assert d["median_r2"] >= 0.95
        assert all(v["a"] > 0 for v in d["layers"].values())
    names = list(docs[0]["layers"])
    rho = spearman([docs[0]["layers"][n]["a"] for n in names], [docs[1]["layers"][n]["a"] for n in names])
    assert rho >= 0.8


def test_data_aware_coefficient_is_the_cross_entropy_on_the_text(trained_tiny_llama_dir, tmp_path):
    """The 'linear' data-aware loss term: a_l from `--text-file` is the linearity-theorem coefficient
    of the next-token cross-entropy on that text, i.e. a direct finite-difference fit of the whole
    model's CE (plain forward, labels = the windows) under the same noise."""
    from qpalette.calibration.data import text_windows

    model_dir, text = trained_tiny_llama_dir
    name = "model.layers.0.mlp.down_proj"
    doc = calibrate(_opts(model_dir, tmp_path / "s.json", text_file=str(text), num_seqs=4, seq_len=128,
                          layers=r"layers\.0\.mlp\.down"), log=lambda m: None)
    assert doc["protocol"] == "data-aware" and "cross-entropy" in doc["loss"]
    row = doc["layers"][name]
    model, tok = load_model(model_dir, "cpu", torch.float32)
    ids = text_windows(tok, text.read_text(encoding="utf-8", errors="replace"), 4, 128)
    index = [n for n, _m, _b in linear_layers(model)].index(name)
    w = model.get_submodule(name).weight
    w0, eps = w.detach().clone(), noise_direction(w.shape, 0, index, 0, "cpu")
    ts, deltas = noise_levels(4), []
    with torch.no_grad():
        base = float(model(input_ids=ids, labels=ids).loss)
        for t in ts:
            w.copy_(w0 + eps * (t * float(torch.linalg.vector_norm(w0))))
            deltas.append(float(model(input_ids=ids, labels=ids).loss) - base)
    a, _r2 = fit_through_origin(ts, deltas)
    assert row["delta_ce"] == pytest.approx(deltas, rel=1e-3, abs=1e-6)
    assert row["a"] == pytest.approx(a, rel=1e-3) and a > 0
    kl = calibrate(_opts(model_dir, tmp_path / "k.json", text_file=str(text), num_seqs=4, seq_len=128,
                         layers=r"layers\.0\.mlp\.down", loss="kl"), log=lambda m: None)
    # near a minimum the KL to the original is close to the CE increase, but another quantity
    assert "KL" in kl["loss"] and "delta_kl" in kl["layers"][name] and kl["layers"][name]["a"] != row["a"]
