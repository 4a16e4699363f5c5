#!/usr/bin/env python3
"""Benchmark the fused dequantize + matmul kernels on Llama-3.1-8B shapes.

For each shape × palette entry × batch size: median time of one call under CUDA-graph replay
(weights rotated among enough copies to defeat the L2 cache, qpalette.kernel_timing), achieved
bandwidth as a fraction of the measured device-to-device copy bandwidth (bytes moved = codes +
row scales + activations + output; the roofline time is bytes / copy bandwidth), and FP16 cuBLAS
(F.linear) measured in the same run. Writes bench_kernels.md and bench_kernels.json under --out.

    python scripts/bench_kernels.py --out results/kernels [--entries tcq-2.0,nuq-4] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpalette.measure import timing as kt
from qpalette.quant.palette import PALETTE  # noqa: E402

SHAPES = {
    "q/o 4096x4096": (4096, 4096),
    "k/v 1024x4096": (1024, 4096),
    "qkv 6144x4096": (6144, 4096),
    "gate/up 14336x4096": (14336, 4096),
    "gateup 28672x4096": (28672, 4096),
    "down 4096x14336": (4096, 14336),
}
TARGETS_US = {"tcq-2.0": 8.0, "tcq-3.0": 10.0, "tcq-4.0": 13.0, "nuq-4": 13.0, "vq-4.0": 13.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for bench_kernels.md and bench_kernels.json")
    ap.add_argument("--entries", default="all", help="comma-separated palette entries (default: all 34)")
    ap.add_argument("--shapes", default="all", help="comma-separated OUTxIN shapes (default: the six Llama shapes)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = ap.parse_args()

    entries = list(PALETTE) if args.entries == "all" else [e.strip() for e in args.entries.split(",")]
    shapes = SHAPES if args.shapes == "all" else {
        s: tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    bw = kt.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows_out = []
    for label, (r, c) in shapes.items():
        fp16 = kt.time_fp16(r, c, batches, dtype)
        for m in batches:
            rows_out.append({"shape": label, "rows": r, "cols": c, "entry": "fp16", "bits": 16, "batch": m,
                             "us": fp16[m] * 1e6, "bytes": r * c * 2 + 2 * m * (r + c),
                             "roofline_fraction": (r * c * 2 + 2 * m * (r + c)) / bw / fp16[m]})
        for name in entries:
            times, nbytes = kt.time_quantized(name, r, c, batches, dtype)
            for m in batches:
                moved = nbytes + 2 * m * (r + c)
                rows_out.append({"shape": label, "rows": r, "cols": c, "entry": name,
                                 "bits": PALETTE[name].bits, "batch": m, "us": times[m] * 1e6,
                                 "bytes": moved, "roofline_fraction": moved / bw / times[m],
                                 "speedup_vs_fp16": fp16[m] / times[m]})
            print(f"{label:20s} {name:14s} " + " ".join(f"b{m}={times[m] * 1e6:7.2f}us" for m in batches)
                  + f"  (fp16 b1 {fp16[batches[0]] * 1e6:.1f}us)", flush=True)
        # partial results after every shape (a run cut short keeps what it measured)
        (out / "bench_kernels.partial.json").write_text(json.dumps({"rows": rows_out}, indent=1))
    rot = {n: kt.time_rotate(n, batches, dtype) for n in sorted({c for _, c in shapes.values()})}
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "dtype": args.dtype,
        "copy_bandwidth_Bps": bw, "l2_flush_bytes": kt.L2_FLUSH_BYTES, "seconds": time.time() - t0,
        "method": "median of 15 CUDA-graph replays / calls per graph; weights cycled through copies "
                  "totalling >= l2_flush_bytes",
        "rotate_us": {str(n): {str(m): t * 1e6 for m, t in v.items()} for n, v in rot.items()},
    }
    (out / "bench_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1))
    md = render(rows_out, batches, meta)
    (out / "bench_kernels.md").write_text(md)
    print(md)


def render(rows, batches, meta) -> str:
    lines = [f"# Kernel benchmark — {meta['device']}, {meta['dtype']} activations",
             "",
             f"Copy bandwidth {meta['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write). Times in µs "
             "(median under CUDA-graph replay, L2 defeated); `bw` = roofline fraction at batch 1 "
             "(bytes moved / copy bandwidth / time).",
             ""]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    for shape in shapes:
        sub = [r for r in rows if r["shape"] == shape]
        lines += [f"## {shape}", "", "| entry | " + " | ".join(f"b{m} µs" for m in batches)
                  + " | bw b1 | b8/b1 |", "|---|" + "---|" * (len(batches) + 2)]
        for entry in dict.fromkeys(r["entry"] for r in sub):
            e = {r["batch"]: r for r in sub if r["entry"] == entry}
            ratio = e[batches[-1]]["us"] / e[batches[0]]["us"]
            lines.append(f"| {entry} | " + " | ".join(f"{e[m]['us']:.2f}" for m in batches)
                         + f" | {e[batches[0]]['roofline_fraction']:.0%} | {ratio:.2f} |")
        lines.append("")
    big = [r for r in rows if r["shape"].startswith("gate/up") and r["batch"] == batches[0]]
    if big:
        lines += ["## Targets (14336×4096, batch 1)", ""]
        for r in big:
            if r["entry"] in TARGETS_US:
                t = TARGETS_US[r["entry"]]
                lines.append(f"- {r['entry']}: {r['us']:.2f} µs (target ≤ {t} µs: "
                             f"{'met' if r['us'] <= t else 'missed'})")
        lines.append("")
    lines += ["## Online Hadamard transform (µs)", ""]
    for n, v in meta["rotate_us"].items():
        lines.append(f"- n = {n}: " + ", ".join(f"b{m} {t:.2f}" for m, t in v.items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
