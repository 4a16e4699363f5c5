#!/usr/bin/env python3
"""One GEMV call per shape, marked for Nsight Compute: what `ncu` profiles when a kernel needs
reading (stall reasons, issue rate, memory throughput), without the benchmark's graph replay.

    ncu --set full --cache-control none --nvtx --nvtx-include "qpalette/" -o REPORT \\
        python scripts/profile_gemv.py --entry tcq-2.0 --shapes 4096x14336,14336x4096 [--batch 1] [--rotate]

`--cache-control none` keeps the caches between ncu's replay passes, as when the benchmark runs the
kernel back to back. ncu's default flushes them before each pass, and the cold instruction cache then
shows as a large "no instruction" stall (4.4-6.5 cycles an instruction against 0.1 warm on an H200:
results/kernels_h200/v15/ncu/warp_state.md).

Each shape gets random codes of the entry (speed does not depend on their values), a warm-up call
outside any range (it builds the kernels and uploads the table), then exactly one call inside the
NVTX push/pop range `qpalette` (no slash in the name: ncu reads "/" as nesting), so
`--nvtx-include "qpalette/"` selects one launch a shape, in the order printed.
Without a GPU it runs the same calls on the reference (a dry run of the arguments).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpalette.errors import InputError, QpaletteError  # noqa: E402
from qpalette.measure import timing  # noqa: E402
from qpalette.quant.incoherence import pack_signs, random_signs  # noqa: E402
from qpalette.quant.palette import get_quantizer  # noqa: E402
from qpalette.runtime import lanes, ops  # noqa: E402

NVTX_RANGE = "qpalette"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """--shapes (timing.parse_shapes), each side a multiple of 16 as the GEMV's tiles need."""
    shapes = timing.parse_shapes(text)
    for rows, cols in shapes:
        if rows % 16 or cols % 16:
            raise InputError(f"--shapes {rows}x{cols}: write OUTxIN with both multiples of 16, e.g. 4096x14336")
    return shapes


def profile_one(entry: str, rows: int, cols: int, batch: int, rotate: bool, device: torch.device) -> str:
    """Warm up, then one call inside the NVTX range `qpalette`; returns what it was."""
    gen = torch.Generator().manual_seed(0)
    stored = {k: v.to(device) for k, v in get_quantizer(entry).random_tensors(rows, cols, gen).items()}
    tensors = lanes.pack(entry, stored)
    x = torch.randn(batch, cols, generator=gen).to(device, torch.float16 if device.type == "cuda" else torch.float32)
    signs = pack_signs(random_signs(cols, 1)).to(device) if rotate else None

    def call():
        if signs is None:
            return ops.quantized_matmul(x, entry, tensors, (rows, cols))
        return ops.rotated_matmul(x, signs, entry, tensors, (rows, cols))

    call()
    name = f"{entry} {rows}x{cols} batch {batch}" + (" rotated" if rotate else "")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    else:
        call()
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entry", default="tcq-2.0", help="palette entry (default tcq-2.0)")
    ap.add_argument("--shapes", default="4096x14336,14336x4096", help="comma-separated OUTxIN")
    ap.add_argument("--batch", type=int, default=1, help="activation rows, 1–8 for the fused GEMV")
    ap.add_argument("--rotate", action="store_true", help="the online rotation fused into the GEMV (rotated_matmul)")
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        get_quantizer(args.entry)
        if not 1 <= args.batch <= ops.FUSED_MAX_ROWS:
            raise InputError(f"--batch {args.batch}: the fused GEMV takes 1–{ops.FUSED_MAX_ROWS} rows")
    except QpaletteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("no GPU: a dry run on the reference (nothing to profile)")
    for rows, cols in shapes:
        print(profile_one(args.entry, rows, cols, args.batch, args.rotate, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
