"""Wall time of quantizing a rows×cols Gaussian matrix with palette entries (TCQ by default).

On CPU a 4096×4096 TCQ matrix takes about an hour, so `--slice-rows` quantizes only that many
rows and extrapolates linearly (the Viterbi cost is the same for every 16×16 tile).
Prints one line per entry and, with --json, a JSON list.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qpalette.quant.palette import get_quantizer


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(name: str, rows: int, cols: int, slice_rows: int, device: str) -> dict:
    q = get_quantizer(name)
    w = torch.randn(slice_rows, cols, generator=torch.Generator().manual_seed(0)).to(device)
    q.quantize(w[:16, : min(cols, 64)])  # warm up (codebook load, kernels)
    sync(device)
    t0 = time.perf_counter()
    qm = q.quantize(w)
    sync(device)
    dt = time.perf_counter() - t0
    nmse = float((q.dequantize(qm) - w).pow(2).sum() / w.pow(2).sum())
    full = dt * rows / slice_rows
    return {"quantizer": name, "device": device, "shape": [rows, cols], "measured_rows": slice_rows,
            "seconds_measured": dt, "seconds_full_matrix": full, "nmse": nmse,
            "extrapolated": slice_rows != rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quantizers", default="tcq-2.0,tcq-4.0")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--slice-rows", type=int, default=None, help="quantize only this many rows")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write results to this file")
    args = ap.parse_args()
    slice_rows = args.slice_rows or args.rows
    results = []
    for name in args.quantizers.split(","):
        r = bench(name.strip(), args.rows, args.cols, slice_rows, args.device)
        results.append(r)
        tag = f"extrapolated from {slice_rows} rows" if r["extrapolated"] else "measured"
        print(f"{r['quantizer']:>14} on {args.device}: {r['seconds_full_matrix']:8.1f} s per "
              f"{args.rows}x{args.cols} ({tag}; nmse {r['nmse']:.5f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
