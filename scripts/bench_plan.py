#!/usr/bin/env python3
"""Planner benchmarks.

    python3 scripts/bench_plan.py reference [--distortion ours|paper]
        Llama-3.1-8B with the imported paper tables (profiles/reference): memory plans at
        2.5 / 3.0 / 3.25 / 4.0 bits and speed plans at 190 / 200 tok/s with and without fusion.
    python3 scripts/bench_plan.py scale [--blocks 80] [--seed 0] [--keep DIR]
        A Llama-3-70B-sized instance (80 blocks of 8192/28672 layers, full palette of 34
        entries, fusion on): synthetic sensitivities (the 8B coefficients stretched over 80
        blocks with log-normal noise) and a synthetic latency profile (the RTX 4090 8B table
        scaled by each group's weight count; the two entries it lacks extrapolated), solved
        under speed, memory and combined budgets.

Every plan goes through the same path as `qpalette plan` (qpalette.planning.planner.plan, which returns a Plan).
Prints one line per plan (and --json FILE writes them all).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpalette.models.topology import (
    GROUPS,  # noqa: E402
    linear_layers,  # noqa: E402
)
from qpalette.planning.document import Plan  # noqa: E402
from qpalette.planning.planner import plan  # noqa: E402
from qpalette.quant.palette import PALETTE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "profiles" / "reference"

LLAMA3_70B = {
    "_name_or_path": "meta-llama/Meta-Llama-3-70B (shapes only)", "model_type": "llama",
    "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 80, "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def row(name: str, p: Plan) -> dict:
    t, s = p.totals, p.solver
    return {
        "plan": name,
        "status": s["status"],
        "gap": s["gap"],
        "objective": t["predicted_loss"],
        "avg_bits": t["avg_bits"],
        "bytes": t["bytes"]["total"],
        "tok_per_s": t["tok_per_s"],
        "solve_s": s["solve_time_s"],
        "wall_s": p.provenance["wall_time_s"],
        "variables": s["variables"],
        "fused_groups": sum(1 for b in p.blocks for g in b.groups if len(GROUPS[g.group]) > 1),
        "distortion_gap": p.bound["distortion_gap"],
        "bit_allocation_gap": p.bound["bit_allocation_gap"],
        "ideal_loss": p.bound["ideal_loss"],
    }


def show(r: dict) -> None:
    tok = f"{r['tok_per_s']:.2f}" if r["tok_per_s"] else "  -  "
    byt = f"{r['bytes'] / 1e9:.4f} GB" if r["bytes"] else "-"
    print(
        f"{r['plan']:<34} {r['status']:<8} gap {r['gap']:.1e}  loss {r['objective']:.6f}  "
        f"bits {r['avg_bits']:.4f}  {byt}  {tok} tok/s  fused {r['fused_groups']:>3}  "
        f"solve {r['solve_s']:.2f} s (wall {r['wall_s']:.2f} s)  "
        f"[bound {r['ideal_loss']:.5f} + dist {r['distortion_gap']:.5f} + alloc {r['bit_allocation_gap']:.5f}]",
        flush=True,
    )


def reference(args) -> list[dict]:
    dist = str(REF / "distortion_gaussian.json") if args.distortion == "paper" else None
    common = dict(sensitivity=str(REF / "llama31_8b_sensitivity.json"),
                  latency_profile=str(REF / "rtx4090_latency_llama31_8b.json"),
                  distortion=dist, time_limit_s=args.time_limit)
    out = []
    for b in ("2.5bits", "3.0bits", "3.25bits", "4.0bits"):
        out.append(row(b, plan(str(REF / "llama31_8b"), [b], **common)))
        show(out[-1])
    for speed in ("190tok/s", "200tok/s"):
        for fuse in (True, False):
            name = f"{speed} {'fused' if fuse else 'unfused'}"
            out.append(row(name, plan(str(REF / "llama31_8b"), [speed], fuse=fuse, **common)))
            show(out[-1])
    return out


def synthetic_70b(tmp: Path, seed: int, blocks: int) -> tuple[str, str, str]:
    rng = random.Random(seed)
    cfg = LLAMA3_70B | {"num_hidden_layers": blocks}
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(cfg))
    ref_sens = json.loads((REF / "llama31_8b_sensitivity.json").read_text())["layers"]
    layers = {}
    for l in linear_layers(cfg):
        src = f"model.layers.{l.block * 32 // blocks}." + ("self_attn" if l.kind in "qkvo" else "mlp")
        a = ref_sens[f"{src}.{l.kind}_proj"]["a"] * math.exp(rng.gauss(0, 0.5))
        layers[l.name] = {"a": a, "r2": None, "shape": [l.out_features, l.in_features]}
    sens = {"format": "qpalette.sensitivity/1", "model": cfg["_name_or_path"],
            "protocol": "synthetic (bench_plan.py)", "tokens": None, "layers": layers}
    (tmp / "sens.json").write_text(json.dumps(sens))

    ref = json.loads((REF / "rtx4090_latency_llama31_8b.json").read_text())
    shapes8 = ref["shapes"]
    h, kv, inter = 8192, 1024, 28672
    shapes = {"q": [h, h], "k": [kv, h], "v": [kv, h], "o": [h, h], "gate": [inter, h],
              "up": [inter, h], "down": [h, inter], "qk": [h + kv, h], "kv": [2 * kv, h],
              "qv": [h + kv, h], "qkv": [h + 2 * kv, h], "gateup": [2 * inter, h]}
    groups = {}
    for g, row_ in ref["groups"].items():
        ratio = (shapes[g][0] * shapes[g][1]) / (shapes8[g][0] * shapes8[g][1])
        lat = {q: t * ratio * math.exp(rng.gauss(0, 0.03)) for q, t in row_.items()}
        # entries the reference lacks (tcq-1.0, half-tcq-1.25): scale the next larger entry
        for name, q in PALETTE.items():
            if name not in lat:
                up = min((p for p in PALETTE.values() if p.family == q.family and p.bits > q.bits
                          and p.name in lat), key=lambda p: p.bits)
                lat[name] = lat[up.name] * (q.bits / up.bits) ** 0.5
        groups[g] = lat
    prof = {"format": "qpalette.latency/1", "model": cfg["_name_or_path"], "device": "synthetic",
            "batch_size": 1, "constant_s": ref["constant_s"] * 2.5, "shapes": shapes, "groups": groups}
    (tmp / "lat.json").write_text(json.dumps(prof))
    return str(tmp / "model"), str(tmp / "sens.json"), str(tmp / "lat.json")


def scale(args) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        if args.keep:  # keep the synthetic inputs for `qpalette plan` runs
            args.keep.mkdir(parents=True, exist_ok=False)
            d = str(args.keep)
        model, sens, lat = synthetic_70b(Path(d), args.seed, args.blocks)
        if args.keep:
            print(f"synthetic inputs: {model} (config.json), {sens}, {lat}")
        common = dict(sensitivity=sens, latency_profile=lat, time_limit_s=args.time_limit)
        # fastest possible plan, to place the speed budgets
        fast = None
        try:
            plan(model, ["100000tok/s"], **common)
        except Exception as e:  # noqa: BLE001 - the infeasibility message carries the number
            fast = float(str(e).split("fastest feasible is ")[1].split(" tok/s")[0])
        print(f"{args.blocks} blocks, {len(PALETTE)} palette entries; fastest plan {fast:.2f} tok/s",
              flush=True)
        mid = plan(model, ["3.25bits"], **common)
        out.append(row("3.25bits fused", mid))
        show(out[-1])
        v = mid.totals["tok_per_s"]  # speed budgets where they bind at 2-3.25 bits
        budgets = [[f"{v * 1.1:.2f}tok/s"], [f"{v * 1.25:.2f}tok/s"], [f"{v * 1.5:.2f}tok/s"],
                   ["3.25bits", f"{v * 1.1:.2f}tok/s"], ["36GB", f"{v * 1.2:.2f}tok/s"]]
        for b in budgets:
            t = time.time()
            p = plan(model, b, **common)
            out.append(row(",".join(b) + " fused", p))
            out[-1]["wall_s"] = time.time() - t
            show(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["reference", "scale"])
    ap.add_argument("--distortion", choices=["ours", "paper"], default="ours")
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="scale: write the synthetic inputs into this new folder")
    args = ap.parse_args()
    rows = reference(args) if args.mode == "reference" else scale(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
