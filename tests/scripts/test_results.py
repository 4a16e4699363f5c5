"""scripts/make_results.py on the repository's measured results (run as a user runs it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_results_module():
    spec = importlib.util.spec_from_file_location("make_results", ROOT / "scripts" / "make_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_make_results_regenerates_report_from_results(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_results.py"), "--results", str(ROOT / "results"),
                    "--out", str(out)], check=True)
    text = out.read_text()
    for png in ("quality_smollm2", "linearity_smollm2", "kernels_h100", "decode_llama8b"):
        assert (tmp_path / "results" / f"{png}.png").stat().st_size > 1000
        assert f"results/{png}.png" in text
    script = make_results_module()
    variants = script.speed_variants(ROOT / "results")
    fps = [v for v in variants if v.key == "fp16"]
    assert fps and {v.run for v in variants} == {v.run for v in fps}  # every run shown with its own FP16
    for v in fps:
        fp16 = v.bench["rows"][0]
        gen = f"{fp16['tok_per_s']:.1f}" if fp16.get("tok_per_s") else "–"  # runs that timed the loop only
        run = v.run.removeprefix("speed_llama8b_")
        assert f"| fp16 | {run} | – | 1 | {fp16['loop_tok_per_s']:.1f} | 1.00× | {gen} |" in text
    targets = text[text.index("## Targets"):]
    by_key = {v.key: v for v in variants}
    bit2, fp16 = by_key["2bit"].bench["rows"][0], by_key["2bit"].fp16["rows"][0]  # against its own run's FP16
    ways = [f"loop {bit2['loop_tok_per_s'] / fp16['loop_tok_per_s']:.2f}×"] + (  # every way the run timed
        [f"decoder {bit2['decoder_tok_per_s'] / fp16['decoder_tok_per_s']:.2f}×"] if "decoder_tok_per_s" in bit2 else [])
    assert f"| 2bit plan ≥ 3.0× FP16 decode tok/s (batch 1) | {', '.join(ways)}," in targets
    plans = {p.stem.removeprefix("plan_"): p for run in script.SPEED_RUNS
             for p in sorted((ROOT / "results" / run).glob("plan_speed*.json"))}  # the newest run's file of each
    assert plans and targets.count("| speed plan ") == len(plans)
    for key, plan_file in plans.items():  # the loop's tok/s over the plan's, from the files; an untimed plan says so
        planned = json.loads(plan_file.read_text())["totals"]["tok_per_s"]
        bench = plan_file.parent / f"bench_{key}.json"
        if not bench.is_file():
            assert f"| speed plan {key} lands within 5% of its planned tok/s | not timed ({planned:.1f} planned) | – |" in targets
            continue
        loop = json.loads(bench.read_text())["rows"][0]["loop_tok_per_s"]
        assert f"| speed plan {key} lands within 5% of its planned tok/s | loop {loop / planned:.3f} of {planned:.1f} |" in targets
    assert "host time of one graph call" in text
    h200 = text[text.index("### On an NVIDIA H200"):text.index("## (e)")]
    h200_variants = script.speed_variants(ROOT / "results", script.H200_SPEED_RUNS)
    assert {v.key for v in h200_variants} >= {"fp16", "2bit", "speed300"}
    for v in h200_variants:  # every variant's rows, each against its own run's FP16
        for r in v.bench["rows"]:
            f = next(x for x in v.fp16["rows"] if x["batch_size"] == r["batch_size"])
            ratio = r["loop_tok_per_s"] / f["loop_tok_per_s"]
            assert f"| {v.key} | {v.run.removeprefix('speed_llama8b_')} |" in h200
            assert f" | {r['batch_size']} | {r['loop_tok_per_s']:.1f} | {ratio:.2f}× |" in h200
    update = json.loads((ROOT / "results" / script.KERNEL_UPDATE).read_text())["rows"]
    row = next(r for r in update if r["entry"] == "tcq-2.0" and r["batch"] == 1 and r["shape"].startswith("gate/up"))
    assert f"| {row['shape']} | tcq-2.0 | {row['us']:.1f} |" in text  # the later run's rows replace the full table's
    assert f"`results/{script.KERNEL_UPDATE}`" in text
    att = json.loads((ROOT / "results" / "decode_attention_h100" / "bench_attention.json").read_text())["rows"]
    for r in att:  # every row, the kernel's µs and its gain over transformers' path from the file
        gain = r["transformers sdpa us"] / r["qpalette kernel us"]
        assert f"| {r['batch']} | {r['length']} | {r['roofline_us']:.1f} |" in text
        assert f"{r['qpalette kernel us']:.1f} | {gain:.1f}× |" in text


def _row(name, kind, bits, ppl, **kw):
    return {"name": name, "kind": kind, "bits": bits, "ppl": ppl, "windows": 147, "windows_total": 147, **kw}


def test_data_aware_section_and_targets(tmp_path):
    """The data-aware sweep's table, comparison, cost and target lines come from its rows; without
    the sweep the section says so."""
    script = [sys.executable, str(ROOT / "scripts" / "make_results.py"), "--results", str(tmp_path / "results"),
              "--out", str(tmp_path / "results.md")]
    (tmp_path / "results").mkdir()
    subprocess.run(script, check=True, capture_output=True)
    text = (tmp_path / "results.md").read_text()
    assert "(no data-aware sweep results yet" in text and "| data-aware targets (issue 16) | not measured | – |" in text
    folder = tmp_path / "results" / "sweep_smollm2_data_aware"
    folder.mkdir()
    rows = [_row("fp", "original", 16.0, 22.0, method="fp16"),
            _row("da-msq-3.0", "data-aware", 3.03, 27.0, method="msq", loss_term="linear", compress_s=90.0),
            _row("da-msq-act-3.0", "data-aware", 3.03, 26.5, method="msq", loss_term="actual", compress_s=95.0),
            _row("da-tcq-3.0", "data-aware", 3.03, 36.0, method="uniform", compress_s=120.0),
            _row("df-tcq-3.0", "data-free", 3.03, 63.4, method="uniform", compress_s=50.0),
            _row("hqq-3-g64", "peer", 3.7, 40.0, method="hqq", quantize_s=3.0, notes="hqq"),
            _row("bnb-nf4", "peer", 4.5, 25.0, method="bnb", quantize_s=2.0, notes="nf4")]
    (folder / "sweep.json").write_text(json.dumps({"format": "qpalette.sweep/2", "text": "file:test.txt", "ctx": 2048,
                                                   "device": "NVIDIA H100", "dtype": "float16", "rows": rows,
                                                   "failed": [{"name": "hqq-4-g64", "error": "ImportError: x"}]}))
    (folder / "collect.json").write_text(json.dumps({"device": "NVIDIA H100", "steps": {
        "hessians": {"seconds": 12.5, "tokens": 262144}}}))
    subprocess.run(script, check=True, capture_output=True)
    text = (tmp_path / "results.md").read_text()
    assert (tmp_path / "results" / "data_aware_smollm2.png").stat().st_size > 1000
    assert "| da-msq-act-3.0 | data-aware | 3.030 | 26.50 | +20.5% | 95.0 | actual loss term |" in text
    assert "| hqq-4-g64 | failed |" in text
    assert "| 3.0 bits | 27.00 | – | 26.50 |" in text
    assert "| tcq-3.0 | 50.0 | 120.0 | 2.40× |" in text and "Hessian collection: 12.5 s" in text
    assert "| da-msq-3.0 perplexity ≤ 27.5 | 27.00 | yes |" in text
    assert "| da-tcq-3.0 perplexity ≤ 35 | 36.00 | no |" in text
    assert "| da-msq-2.5 perplexity ≤ 33.7 | not measured | – |" in text
    assert "| a qpalette row beats hqq-3-g64 (3.700 bits) at ≤ its bits | da-msq-act-3.0 26.50 vs 40.00 | yes |" in text
    assert "| da-tcq-3.0 compress ≤ 2× data-free | 2.40× | no |" in text
