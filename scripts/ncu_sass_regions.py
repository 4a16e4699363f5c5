#!/usr/bin/env python3
"""Where one kernel launch spends its warps' time, by stretch of SASS: reads the per-instruction
table Nsight Compute exports and sums its warp-stall samples over windows of executed instructions.

    ncu --set full --import-source no --nvtx --nvtx-include "qpalette/" -o REPORT \\
        python scripts/profile_gemv.py --entry tcq-2.0 --shapes 14336x4096 --batch 1
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/ncu_sass_regions.py sass.csv [--window 100] [--launch 0]

For each window of --window instructions that ran: the share of the launch's stall samples, the
three largest stall reasons (ncu's names less `stall_`) and the memory, barrier and mma opcodes in
it, so a prologue, a main loop and an epilogue read apart; then the instructions with the most
samples. A sample counts a warp at an instruction whether it issued (`selected`) or waited.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
KEY_OPS = ("HMMA", "LDS", "STS", "LDG", "STG", "BAR", "SHFL", "UCGABAR_ARV", "UCGABAR_WAIT", "MEMBAR", "CCTL")


def launches(path: Path) -> list[list[dict[str, str]]]:
    """The export's launches in order, each its instruction rows (column name → text)."""
    out, header = [], None
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                out.append([])
                header = None
            elif row and row[0] == "Address":
                header = row
            elif row and header and out:
                out[-1].append(dict(zip(header, row)))
    return out


def opcode(source: str) -> str:
    words = source.split()
    return (words[1] if words and words[0].startswith("@") else words[0] if words else "").split(".")[0]


def _count(row: dict[str, str], key: str) -> int:
    return int(row.get(key) or 0)


def windows(rows: list[dict[str, str]], width: int) -> list[dict]:
    """Per window of `width` instructions with any executed: first index, instructions run, samples,
    the top stall reasons and the key opcodes."""
    stalls = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    out = []
    for start in range(0, len(rows), width):
        ran = [r for r in rows[start:start + width] if _count(r, EXECUTED)]
        if not ran:
            continue
        reasons = {s[len("stall_"):]: sum(_count(r, s) for r in ran) for s in stalls}
        out.append({"first": start, "instructions": len(ran), "samples": sum(_count(r, SAMPLES) for r in ran),
                    "reasons": sorted(((v, k) for k, v in reasons.items() if v), reverse=True)[:3],
                    "ops": sorted({opcode(r["Source"]) for r in ran} & set(KEY_OPS))})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path, help="ncu -i REPORT --page source --csv --print-source sass > this file")
    ap.add_argument("--window", type=int, default=100, help="instructions a window")
    ap.add_argument("--launch", type=int, default=0, help="which launch of the export (0: the first)")
    ap.add_argument("--top", type=int, default=10, help="instructions with the most samples to list")
    a = ap.parse_args(argv)
    found = launches(a.csv) if a.csv.is_file() else []
    if a.launch >= len(found):
        print(f"{a.csv}: no launch {a.launch} (it holds {len(found)}); export one with "
              "ncu -i REPORT --page source --csv --print-source sass", file=sys.stderr)
        return 2
    rows = found[a.launch]
    total = sum(_count(r, SAMPLES) for r in rows) or 1
    print(f"launch {a.launch} of {len(found)}: {len(rows)} instructions, {total} samples")
    for w in windows(rows, a.window):
        reasons = " ".join(f"{k}={100 * v / max(w['samples'], 1):.0f}%" for v, k in w["reasons"])
        print(f"{w['first']:6d}+  ran {w['instructions']:4d}  samples {100 * w['samples'] / total:5.1f}%  "
              f"{reasons:40s} {','.join(w['ops'])}")
    print("instructions with the most samples:")
    for i, r in sorted(enumerate(rows), key=lambda ir: -_count(ir[1], SAMPLES))[:a.top]:
        print(f"{i:6d}  {100 * _count(r, SAMPLES) / total:5.1f}%  {r['Source'].strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
