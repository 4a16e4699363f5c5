"""`qpalette plan`: inputs, errors, the reference tables, output files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpalette.cli import app
from qpalette.errors import BudgetError, InputError
from qpalette.models.topology import linear_layers, load_config, unquantized_params
from qpalette.planning.budget import parse_budgets
from qpalette.planning.document import PLAN_FORMAT, Plan, block_table, summary
from qpalette.planning.inputs import LatencyProfile, Sensitivity
from qpalette.planning.planner import plan

REF = Path(__file__).resolve().parents[2] / "profiles" / "reference"
MODEL = str(REF / "llama31_8b")
SENS = str(REF / "llama31_8b_sensitivity.json")
LAT = str(REF / "rtx4090_latency_llama31_8b.json")
runner = CliRunner()


def test_budget_parsing():
    b = parse_budgets(["3.25bits", "2.4GB,200tok/s"])
    assert [(x.kind, x.value) for x in b] == [("bits", 3.25), ("bytes", 2.4e9), ("latency", 0.005)]
    assert parse_budgets(["1GiB"])[0].value == 2**30
    assert parse_budgets(["5ms"])[0].value == pytest.approx(0.005)
    assert parse_budgets(["900 MB"])[0].value == 9e8
    for bad in ["3.25", "abc", "-3bits", "3bits,4bits", "2GBs"]:
        with pytest.raises(BudgetError):
            parse_budgets([bad])


def test_llama31_8b_shapes_and_parameter_count():
    cfg = load_config(MODEL)
    layers = linear_layers(cfg)
    assert len(layers) == 224
    assert (layers[1].out_features, layers[1].in_features) == (1024, 4096)
    assert (layers[6].out_features, layers[6].in_features) == (4096, 14336)
    total = sum(l.numel for l in layers) + sum(unquantized_params(cfg).values())
    assert total == 8_030_261_248  # Llama-3.1-8B


def test_reference_tables_imported():
    prof = LatencyProfile.load(LAT)
    assert prof.batch_size == 1 and set(prof.groups) >= {"qkv", "gateup", "down"}
    assert "tcq-1.0" not in prof.quantizers() and "half-tcq-3.25" in prof.quantizers()
    sens = json.loads(Path(SENS).read_text())
    assert sens["format"] == "qpalette.sensitivity/1" and len(sens["layers"]) == 224


def test_reference_plans_fusion_beats_paper_claims():
    """docs/method.md §5: fusion-aware reaches 200 tok/s, unfused 190 tok/s (reference tables)."""
    dist = str(REF / "distortion_gaussian.json")
    fused = plan(MODEL, ["200tok/s"], sensitivity=SENS, latency_profile=LAT, distortion=dist)
    unfused = plan(MODEL, ["190tok/s"], sensitivity=SENS, latency_profile=LAT, distortion=dist,
                   fuse=False)
    for p, speed in ((fused, 200), (unfused, 190)):
        assert p.solver["status"] == "optimal"
        assert p.totals["tok_per_s"] >= speed * (1 - 1e-12)
    assert fused.totals["predicted_loss"] < unfused.totals["predicted_loss"]
    assert all(len(g.layers) == 1 for b in unfused.blocks for g in b.groups)
    assert any(g.group in ("qkv", "gateup") for b in fused.blocks for g in b.groups)


def test_cli_memory_plan_writes_json_png_and_show(tmp_path):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["plan", MODEL, "-b", "3.25bits", "-s", SENS, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "optimal" in r.output and "distortion gap" in r.output
    p = json.loads(out.read_text())
    assert abs(p["totals"]["avg_bits"] - 3.25) < 1e-9
    assert p["totals"]["bytes"]["total"] == (
        sum(v["bytes"] for v in p["layers"].values()) + p["totals"]["bytes"]["codebooks"]
        + p["totals"]["bytes"]["sign_vectors"] + p["totals"]["bytes"]["unquantized_modules"]
    )
    assert p["provenance"]["sensitivity"]["sha256"] and p["provenance"]["sensitivity"]["path"] == "qpalette:profiles/reference/llama31_8b_sensitivity.json"
    assert (tmp_path / "p.png").stat().st_size > 1000
    r = runner.invoke(app, ["plan", "--show", str(out)])
    assert r.exit_code == 0 and "model.layers.31.mlp.down_proj" in r.output


def test_cli_byte_budget_is_met(tmp_path):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["plan", MODEL, "-b", "4.5GB", "-s", SENS, "-o", str(out), "--no-plot"])
    assert r.exit_code == 0, r.output
    p = json.loads(out.read_text())
    assert 4.49e9 < p["totals"]["bytes"]["total"] <= 4.5e9


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "/nonexistent", "-b", "3bits", "-s", SENS], "no such directory"),
        (["plan", MODEL, "-b", "3 furlongs", "-s", SENS], "unknown unit"),
        (["plan", MODEL, "-b", "0.5bits", "-s", SENS], "smallest feasible is 1 bits"),
        (["plan", MODEL, "-b", "1GB", "-s", SENS], "smallest feasible is 2.977"),
        (["plan", MODEL, "-b", "400tok/s", "-s", SENS, "-l", LAT], "fastest feasible is 270"),
        (["plan", MODEL, "-b", "200tok/s", "-s", SENS, "--batch-size", "4"], "measure one with `qpalette profile"),
        (["plan", MODEL, "-b", "3bits"], "needs sensitivity"),
        (["plan", MODEL, "-b", "3bits", "-s", SENS, "-p", "tcq-9"], "unknown quantizer"),
        (["plan", MODEL, "-b", "200tok/s", "-s", SENS, "-l", LAT, "-p", "tcq-1"], "no latencies for tcq-1.0"),
        (["plan", MODEL, "-b", "200tok/s", "-s", SENS, "-l", LAT, "--batch-size", "4"], "batch size 1"),
        (["plan", "--show", "/nonexistent.json"], "does not exist"),
    ],
)
def test_cli_user_errors_are_clean(tmp_path, args, message):
    r = runner.invoke(app, args + ["-o", str(tmp_path / "p.json")] if "--show" not in args else args)
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def _copy_sens(tmp_path, edit):
    data = json.loads(Path(SENS).read_text())
    edit(data)
    p = tmp_path / "s.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_mismatched_sensitivity_names_the_layer(tmp_path):
    s = _copy_sens(tmp_path, lambda d: d["layers"].pop("model.layers.3.mlp.up_proj"))
    with pytest.raises(InputError, match="model.layers.3.mlp.up_proj"):
        plan(MODEL, ["3bits"], sensitivity=s)
    s = _copy_sens(tmp_path, lambda d: d["layers"]["model.layers.0.self_attn.k_proj"].update(shape=[512, 4096]))
    with pytest.raises(InputError, match="k_proj is 512×4096 there but 1024×4096"):
        plan(MODEL, ["3bits"], sensitivity=s)


def test_mismatched_latency_profile_names_the_group(tmp_path):
    data = json.loads(Path(LAT).read_text())
    data["shapes"]["gateup"] = [2 * 11008, 4096]
    p = tmp_path / "l.json"
    p.write_text(json.dumps(data))
    with pytest.raises(InputError, match="group gateup is 22016×4096 in the profile but 28672×4096"):
        plan(MODEL, ["200tok/s"], sensitivity=SENS, latency_profile=str(p))


def test_model_implied_by_sensitivity_file():
    p = plan(None, ["3bits"], sensitivity=SENS)
    assert p.totals["bytes"]["total"] is None and len(p.layers) == 224
    with pytest.raises(Exception, match="config.json"):
        plan(None, ["3GB"], sensitivity=SENS)


def test_model_directory_with_config(tmp_path):
    shutil.copy(Path(MODEL) / "config.json", tmp_path / "config.json")
    p = plan(str(tmp_path), ["3.0bits", "4.6GB"], sensitivity=SENS)
    assert p.totals["avg_bits"] <= 3.0 and p.totals["bytes"]["total"] <= 4.6e9


SMOLLM2_135M = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
    "tie_word_embeddings": True, "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def test_smollm2_135m_config_plan(tmp_path):
    import random

    cfg = load_config_from(tmp_path, SMOLLM2_135M)
    layers = linear_layers(cfg)
    assert sum(l.numel for l in layers) + sum(unquantized_params(cfg).values()) == 134_515_008
    rng = random.Random(0)
    sens = {"format": "qpalette.sensitivity/1", "model": "smollm2-135m", "protocol": "data-free",
            "tokens": 1024, "layers": {l.name: {"a": rng.lognormvariate(-4, 1.5), "r2": 0.99,
                                                "shape": [l.out_features, l.in_features]} for l in layers}}
    (tmp_path / "s.json").write_text(json.dumps(sens))
    p = plan(str(tmp_path), ["3.25bits", "100MB"], sensitivity=str(tmp_path / "s.json"))
    assert p.solver["status"] == "optimal"
    assert p.totals["avg_bits"] <= 3.25 and p.totals["bytes"]["total"] <= 100e6
    assert p.totals["bytes"]["unquantized_modules"] == 2 * (49152 * 576 + 61 * 576)


def load_config_from(d, cfg):
    (d / "config.json").write_text(json.dumps(cfg))
    return load_config(d)


def test_speed_budget_without_profile_uses_a_matching_shipped_one(tmp_path):
    """SmolLM2 shapes (from its sensitivity file) → the shipped H100 profile of that batch size."""
    sens = str(Path(__file__).resolve().parents[2] / "results" / "calibrate_smollm2" / "sens_gpu_8k_seed0.json")
    for bs in (None, 8):
        p = plan(None, ["150tok/s"], sensitivity=sens, batch_size=bs)
        src = p.provenance["latency_profile"]
        assert src["path"] == f"qpalette:profiles/h100_latency_smollm2-135m_b{bs or 1}.json"
        assert p.provenance["distortion"]["path"] == "qpalette:profiles/distortion_gaussian.json"
        assert any("shipped" in n for n in p.notes)
        assert p.totals["tok_per_s"] >= 150 * (1 - 1e-6)


def test_shipped_profile_follows_the_gpu_at_hand(monkeypatch):
    """Llama-3.1-8B shapes have shipped H100 and H200 profiles: a speed plan made on an H200 prices
    its layers with the H200's; on a GPU without one, or without a GPU, the first (H100) is used."""
    import qpalette.planning.planner as planner
    from qpalette.planning.inputs import find_shipped_profile
    from qpalette.planning.program import check_latency_profile

    layers = linear_layers(load_config(MODEL))
    for gpu, shipped in [(None, "h100"), ("NVIDIA A100-SXM4-80GB", "h100"), ("NVIDIA H200", "h200")]:
        for bs in (1, 8):
            prof = find_shipped_profile(layers, bs, check_latency_profile, gpu)
            assert Path(prof.path).name == f"{shipped}_latency_llama31_8b_b{bs}.json"
    monkeypatch.setattr(planner, "local_gpu_name", lambda: "NVIDIA H200")
    p = plan(MODEL, ["350tok/s"], sensitivity=SENS)
    assert p.provenance["latency_profile"]["path"] == "qpalette:profiles/h200_latency_llama31_8b_b1.json"
    assert any("measured on this GPU" in n for n in p.notes)
    assert p.totals["tok_per_s"] >= 350 * (1 - 1e-6)
    monkeypatch.setattr(planner, "local_gpu_name", lambda: None)
    p = plan(MODEL, ["350tok/s"], sensitivity=SENS)
    assert p.provenance["latency_profile"]["path"] == "qpalette:profiles/h100_latency_llama31_8b_b1.json"
    assert not any("measured on this GPU" in n for n in p.notes)


def test_speed_budget_without_any_matching_profile_says_how_to_get_one(tiny_llama_dir, tmp_path):
    from helpers import fake_sensitivity

    sens = fake_sensitivity(tiny_llama_dir, tmp_path / "s.json")
    with pytest.raises(InputError, match="qpalette profile"):
        plan(str(tiny_llama_dir), ["200tok/s"], sensitivity=str(sens))


RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("**/plan_*.json")), ids=lambda p: p.name)  # not plans.json: a sweep's list
def test_plan_files_round_trip(path, tmp_path):
    """Plan.load reads every results/ plan; to_dict is the file's JSON; save writes its bytes."""
    p = Plan.load(path)
    assert p.to_dict() == json.loads(path.read_text())
    p.save(tmp_path / "p.json")
    assert (tmp_path / "p.json").read_text() == path.read_text()


def test_plan_with_wrong_format_or_fields_is_refused(tmp_path):
    path = next(RESULTS.glob("**/plan*.json"))
    doc = json.loads(path.read_text())
    for fmt in ("qpalette.plan/2", None):
        with pytest.raises(InputError, match="format is .* expected 'qpalette.plan/1'"):
            Plan.from_dict(doc | {"format": fmt})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc | {"format": "qpalette.sensitivity/1"}))
    with pytest.raises(InputError, match="bad.json: format is 'qpalette.sensitivity/1'"):
        Plan.load(bad)
    name = next(iter(doc["layers"]))
    del doc["layers"][name]["bits"]
    with pytest.raises(InputError, match=f"layer {name}: missing 'bits'"):
        Plan.from_dict(doc)
    assert PLAN_FORMAT == "qpalette.plan/1"


def test_input_documents_round_trip_and_check_format():
    prof = LatencyProfile.load(LAT)
    assert LatencyProfile.from_dict(prof.to_dict()).to_dict() == json.loads(Path(LAT).read_text())
    sens = Sensitivity.load(SENS)
    assert sens.to_dict() == json.loads(Path(SENS).read_text())
    with pytest.raises(InputError, match="expected 'qpalette.latency/1'"):
        LatencyProfile.from_dict(sens.to_dict())
    with pytest.raises(InputError, match="expected 'qpalette.sensitivity/1'"):
        Sensitivity.from_dict(prof.to_dict())


def test_planner_returns_a_plan_that_round_trips(tmp_path):
    p = plan(MODEL, ["3bits"], sensitivity=SENS)
    assert isinstance(p, Plan)
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p


def _smollm2_with_head_inputs(tmp_path, head_coefficient=True, head_timings=True):
    """SmolLM2's config, a sensitivity file with (or without) lm_head, and the shipped H100 b1
    profile with (or without) made-up lm_head timings (the gate/up group's, scaled by rows)."""
    import random

    cfg = load_config_from(tmp_path, SMOLLM2_135M)
    rng = random.Random(0)
    layers = linear_layers(cfg, lm_head=head_coefficient)
    sens = {"format": "qpalette.sensitivity/1", "model": "smollm2-135m", "protocol": "data-free",
            "tokens": 1024, "layers": {l.name: {"a": rng.lognormvariate(-4, 1.5), "r2": 0.99,
                                                "shape": [l.out_features, l.in_features]} for l in layers}}
    (tmp_path / "s.json").write_text(json.dumps(sens))
    prof = json.loads((RESULTS.parent / "profiles" / "h100_latency_smollm2-135m_b1.json").read_text())
    prof["shapes"].pop("head", None)
    prof["groups"].pop("head", None)
    prof["constant"] = {k: v for k, v in prof["constant"].items() if not k.startswith("lm_head")}
    if head_timings:
        prof["shapes"]["head"] = [49152, 576]
        prof["groups"]["head"] = {q: t * 16 for q, t in prof["groups"]["gateup"].items()}
        prof["constant"] |= {"lm_head_s": 2e-4, "lm_head_rotation_s": 5e-6}
    (tmp_path / "lat.json").write_text(json.dumps(prof))
    return str(tmp_path / "s.json"), str(tmp_path / "lat.json"), prof


def test_lm_head_is_planned_under_a_speed_budget(tmp_path):
    sens, lat, prof = _smollm2_with_head_inputs(tmp_path)
    p = plan(str(tmp_path), ["150tok/s"], sensitivity=sens, latency_profile=lat)
    assert "lm_head" in p.layers and p.options["lm_head"] == "quantized"
    assert p.layers["lm_head"].quantizer in prof["groups"]["head"]
    assert any("lm_head quantized" in n for n in p.notes)
    head_block = [b for b in p.blocks if any("lm_head" in g.layers for g in b.groups)]
    assert len(head_block) == 1 and head_block[0].groups[0].group == "head"
    constant = prof["constant_s"] - 2e-4 + 5e-6  # the 16-bit head out, its rotation in
    assert p.totals["latency_s"] == pytest.approx(sum(b.latency_s for b in p.blocks) + constant)
    assert p.totals["tok_per_s"] >= 150 * (1 - 1e-6)
    assert "lm_head" in summary(p) and "lm_head" in block_table(p)
    kept = plan(str(tmp_path), ["150tok/s"], sensitivity=sens, latency_profile=lat, lm_head="keep")
    assert "lm_head" not in kept.layers and kept.options["lm_head"] == "16-bit"
    assert kept.totals["latency_s"] == pytest.approx(sum(b.latency_s for b in kept.blocks) + prof["constant_s"])


def test_a_measured_quantized_head_constant_is_used(tmp_path):
    """Profiles that measured the step with a quantized lm_head price such plans with that constant."""
    sens, lat, prof = _smollm2_with_head_inputs(tmp_path)
    prof["constant"]["constant_quantized_head_s"] = 7e-4
    (tmp_path / "lat.json").write_text(json.dumps(prof))
    p = plan(str(tmp_path), ["150tok/s"], sensitivity=sens, latency_profile=lat)
    assert "lm_head" in p.layers
    assert p.totals["latency_s"] == pytest.approx(sum(b.latency_s for b in p.blocks) + 7e-4)


def test_lm_head_under_memory_budgets(tmp_path):
    """Bits budgets keep the head 16-bit unless asked; asked, its weights count in the average and
    (tied to the embedding, which stays) its codes add bytes."""
    sens, _lat, _prof = _smollm2_with_head_inputs(tmp_path)
    auto = plan(str(tmp_path), ["3.25bits"], sensitivity=sens)
    assert "lm_head" not in auto.layers
    q = plan(str(tmp_path), ["3.25bits"], sensitivity=sens, lm_head="quantize")
    assert "lm_head" in q.layers and q.totals["quantized_params"] == auto.totals["quantized_params"] + 49152 * 576
    assert q.totals["avg_bits"] <= 3.25
    assert q.totals["bytes"]["unquantized_modules"] == auto.totals["bytes"]["unquantized_modules"]


def test_lm_head_without_its_inputs(tmp_path):
    sens, lat, _prof = _smollm2_with_head_inputs(tmp_path, head_coefficient=False)
    with pytest.raises(InputError, match="lm_head coefficient.*re-run `qpalette calibrate`"):
        plan(str(tmp_path), ["3.25bits"], sensitivity=sens, lm_head="quantize")
    p = plan(str(tmp_path), ["150tok/s"], sensitivity=sens, latency_profile=lat)
    assert "lm_head" not in p.layers and any("lm_head kept in 16 bits" in n for n in p.notes)
    sens, lat, _prof = _smollm2_with_head_inputs(tmp_path, head_timings=False)
    with pytest.raises(InputError, match="lm_head timings"):
        plan(str(tmp_path), ["150tok/s"], sensitivity=sens, latency_profile=lat, lm_head="quantize")
    with pytest.raises(InputError, match="choose one of"):
        plan(str(tmp_path), ["3.25bits"], sensitivity=sens, lm_head="yes")
