#!/usr/bin/env python3
"""Regenerate docs/results.md and its plots (docs/results/*.png) from the measured results/.

    python3 scripts/make_results.py [--results results] [--out docs/results.md]

Reads (each section is skipped, saying so, when its input is missing):
- results/sweep_smollm2/sweep.json      the first (data-free) sweep: perplexity, KL, predicted loss
- results/sweep_smollm2_data_aware/     scripts/sweep_smollm2.py (GPU): sweep.json (data-free, data-aware
                                         and peer rows), collect.json (calibration costs)
- results/calibrate_smollm2/validation_gpu.json  scripts/validate_linearity.py: random mixes
- results/kernels_h100/bench_kernels.json        scripts/bench_kernels.py
- results/speed_llama8b_v10 … _v12/, results/speed_llama8b_h200/ (+ its run folders)
                                         `qpalette bench --json` of FP16 and compressed synthetic
                                         Llama-3.1-8B models, and their plans (H100, then H200)
Numbers are printed as measured; nothing here is estimated.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAMILY_STYLE = {"tcq": ("TCQ (uniform)", "o-"), "nuq": ("NUQ (uniform)", "s-"), "vq": ("VQ (uniform)", "^-"),
                "msq": ("MSQ plan (mixed)", "D-")}


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def perplexity_axes(ax, fp: dict | None, xlabel: str, title: str, legend_size: int) -> None:
    """The perplexity-vs-bits plots' frame: the original's perplexity as a line, log scale, legend."""
    if fp:
        ax.axhline(fp["ppl"], color="gray", ls="--", label=f"original ({fp['ppl']:.2f})")
    ax.set(xlabel=xlabel, ylabel="WikiText-2 perplexity", yscale="log", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def quality(sweep: dict, figdir: Path) -> list[str]:
    rows = sweep["rows"]
    fp = next((r for r in rows if r["kind"] == "original"), None)
    out = ["## (a) Quality: SmolLM2-135M-Instruct, WikiText-2 perplexity vs average bits", ""]
    out.append(f"Perplexity over all non-overlapping 2048-token windows of `{sweep.get('text', 'WikiText-2')}`; "
               f"KL = mean KL(original ‖ compressed) on sequences sampled from the original (nats/token); "
               f"predicted = Σ a_l·err_l from the calibrated sensitivities and the distortion table (docs/method.md §4). "
               f"Measured on {sweep.get('device', '?')} with `scripts/sweep_smollm2.py` as of commit 1e92b78, "
               f"data-free only ({rows[0].get('dtype', '?')}); section (f) is the data-aware sweep.")
    out += ["", "| configuration | avg bits | perplexity | vs original | KL | predicted loss |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kind"] != "original", r.get("family", r["kind"]), r["avg_bits"])):
        rel = f"{100 * (r['ppl'] / fp['ppl'] - 1):+.1f}%" if fp else "–"
        pred = "–" if r.get("predicted_loss") is None else f"{r['predicted_loss']:.3f}"
        out.append(f"| {r['name']} | {r['avg_bits']:.2f} | {r['ppl']:.2f} | {rel} | {r['kl']:.3f} | {pred} |")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam, (label, style) in FAMILY_STYLE.items():
        pts = sorted((r["avg_bits"], r["ppl"]) for r in rows if r.get("family") == fam)
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for r in rows:
        if r["kind"] == "rtn":
            ax.plot(r["avg_bits"], r["ppl"], "k*", ms=12, label=f"RTN 4-bit g128 ({r['avg_bits']:.2f} bits)")
    perplexity_axes(ax, fp, "average bits per weight (quantized linear layers)", "SmolLM2-135M-Instruct", 8)
    save_figure(fig, figdir / "quality_smollm2.png")
    out += ["", "![perplexity vs bits](results/quality_smollm2.png)", ""]
    return out


def linearity(validation: dict | None, sweep: dict | None, figdir: Path) -> list[str]:
    out = ["## (b) Predicted vs measured loss (linearity theorem)", ""]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    pts = []
    if validation:
        xs = [m["predicted_kl"][0] for m in validation["mixes"]]
        ys = [m["measured_kl"] for m in validation["mixes"]]
        ax.plot(xs, ys, "o", label="random layer mixes (validate_linearity.py)")
        pts += list(zip(xs, ys))
        s = validation["summary"][0]
        out.append(f"Random mixes of NUQ/VQ/TCQ over 10–100% of the layers: Pearson {s['pearson']:.3f}, "
                   f"Spearman {s['spearman']:.3f}, median measured/predicted {s['median_ratio_measured_over_predicted']:.3f} "
                   f"(`results/calibrate_smollm2/validation_gpu.json`).")
    if sweep:
        rows = [r for r in sweep["rows"] if r.get("predicted_loss") and r["kind"] in ("uniform", "msq")]
        for fam, (label, style) in FAMILY_STYLE.items():
            sel = [(r["predicted_loss"], r["kl"]) for r in rows if r.get("family") == fam]
            if sel:
                ax.plot(*zip(*sel), style[0], label=label)
                pts += sel
        out.append("Sweep configurations: measured KL vs predicted loss in the plot (points on the diagonal "
                   "mean the additive model holds).")
    if not pts:
        plt.close(fig)
        return out + ["(no data)", ""]
    hi = max(max(p) for p in pts) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="measured = predicted")
    ax.set(xlabel="predicted Δloss (nats/token)", ylabel="measured KL (nats/token)", xscale="log", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, figdir / "linearity_smollm2.png")
    return out + ["", "![predicted vs measured](results/linearity_smollm2.png)", ""]


# a later bench_kernels run of some entries (and FP16, gemlite), whose rows replace the full table's
KERNEL_UPDATE = "kernels_h100/v12/table/bench_kernels.json"


def overlay_kernels(full: dict, newer: dict | None) -> tuple[dict, set[str]]:
    """The full table with the rows of `newer` in place of its own (same shape, entry and batch),
    and the entries `newer` re-measured."""
    if not newer:
        return full, set()
    key = lambda r: (r["shape"], r["entry"], r["batch"])  # noqa: E731
    fresh = {key(r) for r in newer["rows"]}
    rows = [r for r in full["rows"] if key(r) not in fresh] + newer["rows"]
    return {"meta": full["meta"], "rows": rows}, {r["entry"] for r in newer["rows"]}


def kernels(bench: dict, figdir: Path, updated: set[str] = frozenset()) -> list[str]:
    meta, rows = bench["meta"], bench["rows"]
    bw = meta["copy_bandwidth_Bps"]
    out = ["## (c) Kernel speed vs FP16 and the bandwidth roofline", "",
           f"{meta['device']}, {meta['dtype']} activations, {meta['method']}; copy bandwidth {bw / 1e12:.2f} TB/s. "
           "Full table: `results/kernels_h100/bench_kernels.md`"
           + (f"; {', '.join(sorted(updated))} re-measured later in one run (`results/{KERNEL_UPDATE}`), "
              "whose rows replace the full table's here" if updated else "") + ".", ""]
    size = {r["shape"]: r["rows"] * r["cols"] for r in rows}  # by size, equal sizes by name: a stable order
    shapes = sorted(size, key=lambda s: (size[s], s))
    big = shapes[-2:] if len(shapes) > 1 else shapes
    fig, axes = plt.subplots(1, len(big), figsize=(6 * len(big), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], big):
        sel = [r for r in rows if r["shape"] == shape and r["batch"] == 1]
        fp = next((r for r in sel if r["entry"] == "fp16"), None)
        for fam, (label, style) in FAMILY_STYLE.items():
            pts = sorted((r["bits"], r["us"]) for r in sel if r["entry"].rsplit("-", 1)[0] == fam)
            if pts:
                ax.plot(*zip(*pts), style, label=label.replace(" (uniform)", ""))
        half = sorted((r["bits"], r["us"]) for r in sel if r["entry"].startswith("half-tcq"))
        if half:
            ax.plot(*zip(*half), "x-", label="half-TCQ")
        qs = sorted((r["bits"], r["bytes"] / bw * 1e6) for r in sel
                    if r["entry"] != "fp16" and not r["entry"].startswith("gemlite"))
        for nbits, mark in ((4, "v"), (2, "^")):
            g = next((r for r in sel if r["entry"] == f"gemlite-w{nbits}g64"), None)
            if g:
                ax.plot([g["bits"]], [g["us"]], mark, color="tab:red", label=f"gemlite W{nbits} g64")
        ax.plot(*zip(*qs), "k:", label="roofline (bytes / copy bw)")
        if fp:
            ax.axhline(fp["us"], color="gray", ls="--", label=f"FP16 cuBLAS {fp['us']:.1f} µs")
        ax.set(xlabel="bits per weight", ylabel="µs per call (batch 1)", title=shape)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, figdir / "kernels_h100.png")
    out += ["![kernel time vs bits](results/kernels_h100.png)", "",
            "| shape | entry | b1 µs | b8 µs | FP16 b1 µs | speed-up b1 | roofline b1 |", "|---|---|---|---|---|---|---|"]
    for shape in shapes:
        fp = next((r for r in rows if r["shape"] == shape and r["entry"] == "fp16" and r["batch"] == 1), None)
        for entry in ("tcq-2.0", "tcq-3.0", "tcq-4.0", "nuq-4", "vq-4.0", "half-tcq-3.25"):
            b1 = next((r for r in rows if r["shape"] == shape and r["entry"] == entry and r["batch"] == 1), None)
            b8 = next((r for r in rows if r["shape"] == shape and r["entry"] == entry and r["batch"] == 8), None)
            if b1 and fp:
                out.append(f"| {shape} | {entry} | {b1['us']:.1f} | {b8['us']:.1f} | {fp['us']:.1f} | "
                           f"{fp['us'] / b1['us']:.2f}× | {100 * b1['roofline_fraction']:.0f}% |")
    return out + [""]


# the decode-speed runs shown (results/<run>/bench_*.json, plan_*.json), oldest first: a variant a
# later run timed again (a speed plan re-made on a new profile) is shown from that run only
SPEED_RUNS = ("speed_llama8b_v10", "speed_llama8b_v11", "speed_llama8b_v12")


@dataclass
class SpeedVariant:
    run: str  # the results folder that timed it
    key: str  # fp16, 2bit, 4bit, speedN, …
    bench: dict
    fp16: dict | None  # the same run's FP16 bench: each variant's ratios are against its own run's
    plan: dict | None


def speed_variants(res: Path, runs: tuple[str, ...] = SPEED_RUNS) -> list[SpeedVariant]:
    """Every variant of `runs`, the newest run's where several timed it; an FP16 row for each run
    that keeps a variant."""
    benches = {run: _bench_runs(res / run) for run in runs}
    latest: dict[str, SpeedVariant] = {}
    for run, by_key in benches.items():
        for key, bench in by_key.items():
            if key != "fp16":
                plan = res / run / f"plan_{key}.json"
                latest[key] = SpeedVariant(run, key, bench, by_key.get("fp16"), load(plan) if plan.is_file() else None)
    kept = {v.run for v in latest.values()}
    fp16 = [SpeedVariant(run, "fp16", b, b, None) for run in runs if run in kept
            for b in [benches[run].get("fp16")] if b]
    return fp16 + sorted(latest.values(), key=lambda v: runs.index(v.run))


def speed_row(v: SpeedVariant, r: dict, way: str) -> tuple[list[str], float | None]:
    """The cells of variant v's bench row r (model, run, budget, batch, loop and `way`'s tok/s, each
    against v's own run's FP16, then "planned | loop / planned") and the plan's tok/s at r's batch."""
    b, plan = r["batch_size"], v.plan
    f = next((x for x in v.fp16["rows"] if x["batch_size"] == b), {}) if v.fp16 else {}
    planned = plan["totals"].get("tok_per_s") if plan and plan["options"].get("batch_size", 1) == b else None
    loop, other = r["loop_tok_per_s"], r.get(way)
    ratio = lambda x, y: f"{x / y:.2f}×" if x and y else "–"  # noqa: E731
    return [v.key, v.run.removeprefix("speed_llama8b_"), ", ".join(x["text"] for x in plan["budgets"]) if plan else "–",
            str(b), f"{loop:.1f}", ratio(loop, f.get("loop_tok_per_s")), f"{other:.1f}" if other else "–",
            ratio(other, f.get(way)), "– | –" if planned is None else f"{planned:.1f} | {loop / planned:.3f}"], planned


def speed(res: Path, variants: list[SpeedVariant], figdir: Path) -> list[str]:
    """Section (d) from `variants` (speed_variants of `res`)."""
    out = ["## (d) Decode speed: Llama-3.1-8B shapes (random weights), `qpalette bench`", ""]
    fps = [v for v in variants if v.key == "fp16"]
    if not fps:
        return out + ["(no data)", ""]
    fp = fps[-1].bench
    out.append(f"{fp['device']}, {fp['dtype']}, static KV cache, torch.compile + CUDA graphs = {fp['compiled']}, "
               f"prompt {fp['prompt_len']} tokens, {fp['gen_len']} generated. Two numbers per row, same harness for "
               "FP16 and compressed checkpoints (compressed with `--random-codes`: speed does not depend on code "
               "values): **loop** = the compiled forward alone, one token a step, timed between two CUDA events "
               "(the GPU's time per token); **generate** = transformers' `generate`, median step, which adds its "
               "per-token host work. Planned tok/s come from the plan's latency profile "
               "(`profiles/h100_latency_llama31_8b_b1.json`; its constant is a tcq-2.0 model's compiled step less "
               "its matmuls' isolated times, its blocks counted unfused; each block whose norms and adds run in its "
               "GEMVs subtracts the profile's `fused_block_saving_s`). "
               "2bit and 4bit: every layer and lm_head tcq-2.0, resp. nuq-4 (`compress --scheme E --lm-head`); "
               "speedN: the plan for N tok/s (lm_head 16-bit: the reference sensitivities have no lm_head "
               "coefficient); `…_before`: the same checkpoint on an earlier tree's kernels in the same run; "
               "– where a run timed the loop only. **run**: the results folder (one machine each; every ratio is "
               "against that run's own FP16), whose README says what it measured: "
               + ", ".join(f"`results/{r}/`" for r in SPEED_RUNS) + ". "
               "Earlier runs: `results/speed_llama8b_v2/` … `_v9/`, `results/speed_llama8b/` (v1 kernels).")
    out += ["", "| model | run | plan budget | batch | loop tok/s | loop × FP16 | generate tok/s | generate × FP16 | "
            "loop throughput | planned tok/s | loop / planned |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    bars = []
    for v in variants:
        for r in v.bench["rows"]:
            cells, planned = speed_row(v, r, "tok_per_s")
            out.append("| " + " | ".join(cells[:-1] + [f"{r['loop_throughput_tok_per_s']:.1f}", cells[-1]]) + " |")
            if r["batch_size"] == 1:
                label = v.key if v.key != "fp16" or len(fps) == 1 else f"fp16 {v.run.removeprefix('speed_llama8b_')}"
                bars.append((label, r["loop_tok_per_s"], r.get("tok_per_s") or float("nan"), planned))
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="forward loop")
    ax.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="generate", color="C1")
    planned = [(i, b[3]) for i, b in zip(x, bars) if b[3]]
    if planned:
        ax.plot(*zip(*[(i - 0.2, v) for i, v in planned]), "k_", ms=22, mew=2, label="planned")
    ax.axhline(fps[-1].bench["rows"][0]["loop_tok_per_s"], color="gray", ls="--", lw=1, label="FP16 loop (newest run)")
    ax.set_xticks(list(x), [b[0] for b in bars])
    ax.set(ylabel="tok/s (batch 1)", title="Llama-3.1-8B shapes, H100, batch 1")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, figdir / "decode_llama8b.png")
    newest = [breakdown(res / r, f" — `results/{r}/`") for r in reversed(SPEED_RUNS)]  # of the runs that made one
    return out + ["", "![decode speed](results/decode_llama8b.png)", ""] + (
        next((t for t in newest if t), None)
        or breakdown(res / "speed_llama8b_v4", " — kernels of 2026-11-27, `results/speed_llama8b_v4/`"))


# the H200 decode runs (the same harness; no H100 was available for them), oldest first
H200_SPEED_RUNS = ("speed_llama8b_h200", "speed_llama8b_h200/run_o", "speed_llama8b_h200/run_p",
                   "speed_llama8b_h200/speed_plans_p")


def speed_h200(res: Path) -> list[str]:
    """Section (d)'s H200 table: each variant's newest run against that run's FP16, in the compiled
    loop and qpalette's decoder (the path `generate` uses), with the speed plans' planned tok/s."""
    variants = speed_variants(res, H200_SPEED_RUNS)
    out = ["### On an NVIDIA H200 (`results/speed_llama8b_h200/`)", ""]
    if not variants:
        return out + ["(no data)", ""]
    out += ["Same harness and settings as above, on H200s (one machine a run). The H200 has more memory "
            "bandwidth than the H100, which speeds FP16 up by ~29% and the quantized kernels hardly at all, so "
            "every ratio is smaller. speedN: plans made on the shipped H200 profile "
            "(`profiles/h200_latency_llama31_8b_b1.json`).", "",
            "| model | run | plan budget | batch | loop tok/s | loop × FP16 | decoder tok/s | decoder × FP16 | "
            "planned tok/s | loop / planned |", "|---|---|---|---|---|---|---|---|---|---|"]
    out += ["| " + " | ".join(speed_row(v, r, "decoder_tok_per_s")[0]) + " |" for v in variants for r in v.bench["rows"]]
    return out + [""]


def breakdown(folder: Path, note: str = "") -> list[str]:
    """Where a decode step's GPU time goes (scripts/decode_breakdown.py)."""
    runs = {p.stem.removeprefix("breakdown_"): load(p) for p in sorted(folder.glob("breakdown_*.json"))}
    if not runs:
        return []
    kinds = sorted({k for r in runs.values() for k in r["kinds_s"]}, key=lambda k: -max(r["kinds_s"].get(k, 0) for r in runs.values()))
    out = [f"### Where a decode step goes (batch 1, `scripts/decode_breakdown.py`{note})", "",
           "Kernel time per step from torch.profiler over a few decode steps (`--steps`: the run's README) of the "
           "inductor-compiled forward, by kind; "
           "then the same forward replayed as a CUDA graph, and the host time of one graph call.", "",
           "| ms per step | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for k in kinds:
        out.append(f"| {k} | " + " | ".join(f"{r['kinds_s'].get(k, 0) * 1e3:.3f}" for r in runs.values()) + " |")
    for label, key in (("**sum of kernels**", "kernel_sum_s"), ("CUDA-graph step", "graph_step_s"),
                       ("host time of one graph call", "host_call_s")):
        if all(key in r for r in runs.values()):
            out.append(f"| {label} | " + " | ".join(f"{r[key] * 1e3:.3f}" for r in runs.values()) + " |")
    return out + [""]


DA_STYLE = {("data-free", "msq"): ("MSQ data-free", "D--", "tab:blue"),
            ("data-free", "uniform"): ("TCQ data-free", "o", "tab:blue"),
            ("data-aware", "msq"): ("MSQ data-aware (linear)", "D-", "tab:green"),
            ("data-aware", "uniform"): ("TCQ data-aware", "o", "tab:green")}
PEER_STYLE = {"bnb": ("bitsandbytes NF4", "s", "tab:red"), "hqq": ("HQQ g64", "^", "tab:purple"),
              "rtn": ("RTN", "*", "black")}


def data_aware(folder: Path, figdir: Path) -> list[str]:
    """(f): the data-aware sweep, one table of every row, linear vs actual, the cost, a plot."""
    sweep, costs = load(folder / "sweep.json"), load(folder / "collect.json") or {"steps": {}}
    out = ["## (f) Data-aware quantization and peers: SmolLM2-135M-Instruct, one sweep", ""]
    if not sweep or not sweep["rows"]:
        return out + ["(no data-aware sweep results yet: `scripts/sweep_smollm2.py`)", ""]
    rows, fp = sweep["rows"], next((r for r in sweep["rows"] if r["kind"] == "original"), None)
    steps = costs["steps"]
    cal = ", ".join(f"{k} {v['seconds']:.0f} s ({v.get('tokens') or '?'} tokens)" for k, v in steps.items()
                    if v.get("seconds") is not None)
    out.append(f"Perplexity over {rows[0]['windows']} of the {rows[0]['windows_total']} non-overlapping "
               f"{sweep['ctx']}-token windows of `{sweep['text']}`, every row by the same function, on "
               f"{sweep['device']} ({sweep['dtype']}). Data-aware rows: LDLQ with Hessians of the calibration "
               f"text (WikiText-2 validation), MSQ plans from CE sensitivities ('linear') or the measured loss "
               f"table ('actual'). Bits per weight are stored bits of the quantized block layers (codes, row "
               f"scales, sign vectors and codebooks; peers: codes, scales, zeros, absmax and double-quant "
               f"constants); lm_head stays 16-bit in every row. Calibration on {costs.get('device', '?')}: "
               f"{cal or 'not recorded'}.")
    out += ["", "| row | kind | bits/weight | perplexity | vs original | compress / quantize s | notes |",
            "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kind"] != "original", r["kind"], r["bits"], r["name"])):
        rel = f"{100 * (r['ppl'] / fp['ppl'] - 1):+.1f}%" if fp else "–"
        secs = r.get("compress_s", r.get("quantize_s"))
        note = r.get("notes") or (f"{r['loss_term']} loss term" if r.get("loss_term") else "")
        out.append(f"| {r['name']} | {r['kind']} | {r['bits']:.3f} | {r['ppl']:.2f} | {rel} | "
                   f"{'–' if secs is None else f'{secs:.1f}'} | {note} |")
    for f in sweep.get("failed", []):
        out.append(f"| {f['name']} | failed | – | – | – | – | {f['error'][:120]} |")
    out += [""] + linear_vs_actual(rows) + data_aware_cost(rows, steps, sweep)
    data_aware_plot(rows, fp, figdir)
    return out + ["![perplexity vs bits, data-aware sweep](results/data_aware_smollm2.png)", ""]


def linear_vs_actual(rows: list[dict]) -> list[str]:
    """The paper's Table 9 question: the same budget planned on each loss term."""
    ppl = {r["name"]: r for r in rows}
    out = ["**'linear' vs 'actual' loss terms** (perplexity at the same bit budget; 'table entries' = the "
           "loss table's palette, which the 'actual' plans are restricted to):", "",
           "| budget | linear, whole palette | linear, table entries | actual, table entries |", "|---|---|---|---|"]
    for b in ("2.5", "3.0"):
        cells = [ppl.get(n) for n in (f"da-msq-{b}", f"da-msq-lint-{b}", f"da-msq-act-{b}")]
        if any(cells):
            out.append(f"| {b} bits | " + " | ".join("–" if c is None else f"{c['ppl']:.2f}" for c in cells) + " |")
    return out + [""]


def data_aware_cost(rows: list[dict], steps: dict, sweep: dict) -> list[str]:
    """Data-aware compress time over data-free, for every scheme or budget measured both ways."""
    by = {r["name"]: r for r in rows}
    out = ["**Cost** (compress wall time, the same command with and without `--hessians`):", "",
           "| scheme | data-free s | data-aware s | ratio |", "|---|---|---|---|"]
    for r in rows:
        twin = by.get("df-" + r["name"].removeprefix("da-")) if r["name"].startswith("da-") else None
        if twin and "compress_s" in twin:
            out.append(f"| {r['name'].removeprefix('da-')} | {twin['compress_s']:.1f} | {r['compress_s']:.1f} | "
                       f"{r['compress_s'] / twin['compress_s']:.2f}× |")
    h = steps.get("hessians", {}).get("seconds")
    again = sweep.get("hessians_s") or []
    out.append(f"\nHessian collection: {'not recorded' if h is None else f'{h:.1f} s'} (`qpalette hessians`, "
               f"{steps.get('hessians', {}).get('tokens') or '?'} tokens, model load included)"
               + (f"; collected again in the sweep process: {', '.join(f'{s:.1f} s' for s in again)}" if again else "")
               + ".")
    return out + [""]


def data_aware_plot(rows: list[dict], fp: dict | None, figdir: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (kind, method), (label, style, color) in DA_STYLE.items():
        pts = sorted((r["bits"], r["ppl"]) for r in rows if r["kind"] == kind and r.get("method") == method
                     and r.get("loss_term") != "actual" and "-lint-" not in r["name"])
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=label)
    act = sorted((r["bits"], r["ppl"]) for r in rows if r.get("loss_term") == "actual")
    if act:
        ax.plot(*zip(*act), "P", color="tab:orange", ms=9, label="MSQ data-aware (actual)")
    for method, (label, mark, color) in PEER_STYLE.items():
        pts = [(r["bits"], r["ppl"]) for r in rows if r["kind"] == "peer" and r["method"] == method]
        if pts:
            ax.plot(*zip(*pts), mark, color=color, ms=10, ls="none", label=label)
    perplexity_axes(ax, fp, "stored bits per weight (quantized layers)",
                    "SmolLM2-135M-Instruct: data-free, data-aware and peers", 7)
    save_figure(fig, figdir / "data_aware_smollm2.png")


def data_aware_targets(folder: Path) -> list[str]:
    """Issue 16's targets against the data-aware sweep (nothing when it has not run)."""
    sweep = load(folder / "sweep.json")
    if not sweep or not sweep["rows"]:
        return ["| data-aware targets (issue 16) | not measured | – |"]
    by = {r["name"]: r for r in sweep["rows"]}
    out = []
    for name, limit, op in (("da-msq-3.0", 27.5, "≤"), ("da-msq-2.5", 33.7, "≤"), ("da-tcq-3.0", 35.0, "≤"),
                            ("da-tcq-2.0", 200.0, "<")):
        r = by.get(name)
        if r is None:
            out.append(f"| {name} perplexity {op} {limit:g} | not measured | – |")
            continue
        met = r["ppl"] <= limit if op == "≤" else r["ppl"] < limit
        out.append(f"| {name} perplexity {op} {limit:g} | {r['ppl']:.2f} | {'yes' if met else 'no'} |")
    r, fp = by.get("da-msq-4.0"), by.get("fp")
    if r and fp:
        rel = r["ppl"] / fp["ppl"] - 1
        out.append(f"| da-msq-4.0 within 5% of the original | {100 * rel:+.1f}% | {'yes' if rel <= 0.05 else 'no'} |")
    ours = [r for r in sweep["rows"] if r["kind"] in ("data-free", "data-aware")]
    for p in (r for r in sweep["rows"] if r["kind"] == "peer" and r["method"] != "rtn"):
        best = min((r for r in ours if r["bits"] <= p["bits"]), key=lambda r: r["ppl"], default=None)
        got = "no qpalette row at ≤ its bits" if best is None else f"{best['name']} {best['ppl']:.2f} vs {p['ppl']:.2f}"
        out.append(f"| a qpalette row beats {p['name']} ({p['bits']:.3f} bits) at ≤ its bits | {got} | "
                   f"{'yes' if best and best['ppl'] < p['ppl'] else 'no'} |")
    for r in sweep["rows"]:
        twin = by.get("df-" + r["name"].removeprefix("da-")) if r["name"].startswith("da-") else None
        if twin and "compress_s" in twin and "compress_s" in r:
            ratio = r["compress_s"] / twin["compress_s"]
            out.append(f"| {r['name']} compress ≤ 2× data-free | {ratio:.2f}× | {'yes' if ratio <= 2 else 'no'} |")
    return out


def targets(sweep: dict | None, res: Path, speed_runs: list[SpeedVariant]) -> list[str]:
    """The end-to-end targets, checked against the measured numbers (or said to be unmeasured);
    `speed_runs`: speed_variants of `res`."""
    out = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    if sweep:
        ppl = {r["name"]: r["ppl"] for r in sweep["rows"]}
        for b in ("3.0", "4.0"):
            names = (f"msq-{b}", f"tcq-{b}", f"nuq-{int(float(b))}")
            if all(n in ppl for n in names):
                vals = [ppl[n] for n in names]
                out.append(f"| {b} bits: MSQ ≤ uniform TCQ ≤ uniform NUQ perplexity | "
                           f"{' ≤ '.join(f'{v:.2f}' for v in vals)} | {'yes' if vals == sorted(vals) else 'no'} |")
        if "msq-4.0" in ppl and "fp" in ppl:
            rel = ppl["msq-4.0"] / ppl["fp"] - 1
            out.append(f"| 4-bit MSQ within 3% of FP16 perplexity | {100 * rel:+.1f}% | {'yes' if rel <= 0.03 else 'no'} |")
    variants = {v.key: v for v in speed_runs if v.key != "fp16"}
    b1 = {k: (_row_of(v.bench, 1), v.fp16 and _row_of(v.fp16, 1)) for k, v in variants.items()}
    for key, need in (("2bit", 3.0), ("4bit", 2.0)):
        got, fp1 = b1.get(key, (None, None))
        if got and fp1:
            ratios = {way: got[k] / fp1[k] for way, k in (("loop", "loop_tok_per_s"), ("decoder", "decoder_tok_per_s"),
                                                           ("generate", "tok_per_s")) if got.get(k) and fp1.get(k)}
            said = ", ".join(f"{way} {v:.2f}×" for way, v in ratios.items())
            if "generate" not in ratios:
                said += ", generate not timed"
            out.append(f"| {key} plan ≥ {need:.1f}× FP16 decode tok/s (batch 1) | {said} | "
                       f"{'yes' if min(ratios.values()) >= need else 'no'} |")
        else:
            out.append(f"| {key} plan ≥ {need:.1f}× FP16 decode tok/s (batch 1) | not measured | – |")
    plans = {p.stem.removeprefix("plan_"): (run, p) for run in SPEED_RUNS for p in sorted((res / run).glob("plan_*.json"))}
    for key, (run, path) in sorted(plans.items()):  # each plan's newest file; a plan its run did not time says so
        plan = load(path)
        if not any(x["kind"] == "latency" for x in plan["budgets"]):
            continue
        timed = variants.get(key)
        row, planned = _row_of(timed.bench, 1) if timed and timed.run == run else None, plan["totals"]["tok_per_s"]
        if row is None:
            out.append(f"| speed plan {key} lands within 5% of its planned tok/s | not timed ({planned:.1f} planned) | – |")
            continue
        ratio = row["loop_tok_per_s"] / planned
        out.append(f"| speed plan {key} lands within 5% of its planned tok/s | loop {ratio:.3f} of "
                   f"{planned:.1f} | {'yes' if abs(ratio - 1) <= 0.05 else 'no'} |")
    return out + [""]


def _mode_keys(mode: str) -> tuple[str, str, str]:
    """The bench/2 row keys of one compile mode: generate tok/s, loop tok/s, loop host s a call."""
    if mode == "default":
        return "tok_per_s", "loop_tok_per_s", "loop_host_s"
    return f"tok_per_s_{mode}", f"loop_{mode}_tok_per_s", f"loop_{mode}_host_s"


def _row_of(bench: dict, batch: int) -> dict | None:
    return next((r for r in bench["rows"] if r["batch_size"] == batch), None)


def _bench_runs(folder: Path) -> dict[str, dict]:
    return {p.stem.removeprefix("bench_"): load(p) for p in sorted(folder.glob("bench_*.json"))}


def generation(folder: Path) -> list[str]:
    """(e): the three ways of decoding, side by side, from `qpalette bench` runs (bench/2), one row
    per model, batch size and compile mode of transformers' generate."""
    out = ["## (e) Generation: qpalette's decoder, transformers' generate and the forward loop", ""]
    runs = _bench_runs(folder)
    if not runs:
        return out + ["(no data)", ""]
    any_run = next(iter(runs.values()))
    out.append(f"{any_run['device']}, {any_run['dtype']}, synthetic Llama-3.1-8B (32 blocks), prompt "
               f"{any_run['prompt_len']} tokens, {any_run['gen_len']} generated, one `qpalette bench` per model and "
               f"batch size, one after the other on the same machine (`{folder}/README.md`). "
               "**decoder** = `qpalette generate`'s decoder (decode steps compiled by inductor and replayed as CUDA "
               "graphs, tokens read back behind the GPU), wall time of the whole decode; **generate** = "
               "transformers' `generate`, static cache, compiled (mode *default*: as transformers compiles it; "
               "*deferred*: `qpalette.compile_config(\"deferred\")` inside `qpalette.deferred_stop_check()`); "
               "**loop** = the compiled forward alone (GPU time per token), compiled the same way. Host ms: the "
               "decoder's time to enqueue one step; the loop's time per compiled call.")
    out += ["", "| model | batch | mode | decoder tok/s | decoder / loop | host ms a step | generate tok/s | "
            "generate / loop | loop tok/s | loop host ms a call |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, res in runs.items():
        for r in res["rows"]:
            for mode in res.get("compile_modes", ["default"]):
                gen, loop, host = (r[k] for k in _mode_keys(mode))
                dec = (f"{r['decoder_tok_per_s']:.1f} | {r['decoder_tok_per_s'] / loop:.3f} | "
                       f"{r['decoder_host_step_s'] * 1e3:.3f}") if "decoder_tok_per_s" in r else "– | – | –"
                out.append(f"| {key.split('_b')[0]} | {r['batch_size']} | {mode} | {dec} | {gen:.1f} | "
                           f"{gen / loop:.3f} | {loop:.1f} | {host * 1e3:.3f} |")
    return out + [""]


def generation_targets(folder: Path) -> list[str]:
    """Issue 15's targets: decoder within 5% of the loop, generate within 10% (each compile mode),
    decoder host time ≤ 0.1 ms at batch 1."""
    out = []
    for key, res in _bench_runs(folder).items():
        name = key.split("_b")[0]
        for r in res["rows"]:
            b = r["batch_size"]
            if "decoder_tok_per_s" in r:
                dec = r["decoder_tok_per_s"] / r["loop_tok_per_s"]
                out.append(f"| {name} batch {b}: decoder within 5% of the forward loop | {dec:.3f} | "
                           f"{'yes' if dec >= 0.95 else 'no'} |")
            for mode in res.get("compile_modes", ["default"]):
                gen_key, loop_key, _ = _mode_keys(mode)
                gen = r[gen_key] / r[loop_key]
                out.append(f"| {name} batch {b}: transformers' generate ({mode}) within 10% of the loop | "
                           f"{gen:.3f} | {'yes' if gen >= 0.9 else 'no'} |")
            if b == 1 and "decoder_host_step_s" in r:
                host = r["decoder_host_step_s"] * 1e3
                out.append(f"| {name} batch 1: decoder host time ≤ 0.1 ms a step | {host:.3f} ms | "
                           f"{'yes' if host <= 0.1 else 'no'} |")
    return out


def experts(folder: Path) -> list[str]:
    """(g): a 2-bit MoE on the grouped expert kernels against its FP16 with transformers' fused experts."""
    out = ["## (g) Mixture of experts: synthetic Qwen3-30B-A3B (4 of 48 blocks), 2-bit vs FP16", ""]
    q2, fp, per = (load(folder / f) for f in ("bench_tcq2.json", "bench_fp16_batched_mm.json",
                                               "bench_tcq2_per_expert.json"))
    if not (q2 and fp):
        return out + ["(no data)", ""]
    out.append(f"{q2['device']}, float16, prompt {q2['prompt_len']} tokens, {q2['gen_len']} generated (`{folder}/README.md`). "
               "**tcq-2.0**: every linear layer 2-bit (lm_head 16-bit), experts on qpalette's grouped expert GEMV "
               "(one launch per projection and block over the routed experts); **fp16**: transformers' fused "
               "experts, `batched_mm` (`scripts/bench_hf_experts.py`); **per-expert**: the 2-bit model with "
               "`QPALETTE_GROUPED_EXPERTS=0` (one launch per expert hit, router read back on the host).")
    out += ["", "| model | batch | decoder tok/s | decoder throughput | generate tok/s | loop tok/s | decoder vs fp16 |",
            "|---|---|---|---|---|---|---|"]
    base = {r["batch_size"]: r for r in fp["rows"] if "error" not in r}
    for name, res in (("fp16 batched_mm", fp), ("tcq-2.0", q2), ("tcq-2.0 per-expert", per)):
        for r in (res or {"rows": []})["rows"]:
            b, ref = r["batch_size"], base.get(r["batch_size"])
            ratio = f"{r['decoder_tok_per_s'] / ref['decoder_tok_per_s']:.2f}×" if ref else "–"
            gen = f"{r['tok_per_s']:.1f}" if "tok_per_s" in r else "–"
            loop = f"{r['loop_tok_per_s']:.1f}" if "loop_tok_per_s" in r else "–"
            out.append(f"| {name} | {b} | {r['decoder_tok_per_s']:.1f} | {r['decoder_throughput_tok_per_s']:.1f} | "
                       f"{gen} | {loop} | {ratio} |")
    return out + [""]


ATTENTION_WAYS = ("transformers sdpa", "packed sdpa", "qpalette kernel")


def attention(folder: Path) -> list[str]:
    """(h): one decode layer's attention, transformers' sdpa vs qpalette's kernel (scripts/bench_attention.py)."""
    out = ["## (h) Decode attention: one Llama-3.1-8B layer (32 query heads over 8 KV heads), `scripts/bench_attention.py`", ""]
    run = load(folder / "bench_attention.json")
    if not run:
        return out + ["(no data)", ""]
    out += [f"{run['device']}, float16, µs a layer under CUDA-graph replay with the caches out of L2; roofline = "
            f"K and V read once at the copy bandwidth ({run['copy_bandwidth'] / 1e12:.2f} TB/s). transformers sdpa "
            "copies the cache to every query head, packed sdpa runs the query heads of a KV head as rows of one "
            f"SDPA call, qpalette kernel is `qpalette::decode_attention` (`{folder}/README.md`).", "",
            "| batch | cached keys | roofline | " + " | ".join(ATTENTION_WAYS) + " | kernel vs transformers |",
            "|---|---|---|" + "---|" * len(ATTENTION_WAYS) + "---|"]
    for r in run["rows"]:
        times = " | ".join(f"{r[f'{w} us']:.1f}" for w in ATTENTION_WAYS)
        gain = r["transformers sdpa us"] / r["qpalette kernel us"]
        out.append(f"| {r['batch']} | {r['length']} | {r['roofline_us']:.1f} | {times} | {gain:.1f}× |")
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--out", type=Path, default=Path("docs/results.md"))
    args = ap.parse_args()
    figdir = args.out.parent / "results"
    figdir.mkdir(parents=True, exist_ok=True)
    res = args.results
    sweep = load(res / "sweep_smollm2" / "sweep.json")
    validation = load(res / "calibrate_smollm2" / "validation_gpu.json")
    bench = load(res / "kernels_h100" / "bench_kernels.json")
    bench, updated = overlay_kernels(bench, load(res / KERNEL_UPDATE)) if bench else (bench, set())
    lines = ["# qpalette results", "",
             "Generated by `python3 scripts/make_results.py` from the files in `results/`; every number "
             "below was measured by the script named in its section.", ""]
    lines += quality(sweep, figdir) if sweep else ["## (a) Quality", "", "(no sweep results yet)", ""]
    lines += linearity(validation, sweep, figdir)
    lines += kernels(bench, figdir, updated) if bench else ["## (c) Kernels", "", "(no kernel benchmark yet)", ""]
    speed_runs = speed_variants(res)  # the bench and plan files, read once for (d) and the targets
    lines += speed(res, speed_runs, figdir)
    lines += speed_h200(res)
    lines += generation(res / "generate_h100")
    lines += data_aware(res / "sweep_smollm2_data_aware", figdir)
    lines += experts(res / "moe_h100")
    lines += attention(res / "decode_attention_h100")
    lines += (targets(sweep, res, speed_runs)[:-1] + generation_targets(res / "generate_h100")
              + data_aware_targets(res / "sweep_smollm2_data_aware") + [""])
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} and plots in {figdir}")


if __name__ == "__main__":
    main()
