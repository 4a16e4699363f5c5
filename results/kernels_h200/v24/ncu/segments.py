#!/usr/bin/env python3
"""Executed SASS instructions of one profiled kernel, by straight-line run (consecutive instructions
executed equally often) and by opcode, from `ncu -i REPORT --page source --csv --print-source sass`:

    python segments.py SOURCE.csv [--min-share 0.01]
"""
import argparse
import collections
import csv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--min-share", type=float, default=0.01)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    hdr = rows[1]
    col = {h: i for i, h in enumerate(hdr)}["Instructions Executed"]
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    runs, ops, total = [], collections.Counter(), 0
    for r in data:
        n = int(r[col] or 0)
        total += n
        words = r[1].split()
        ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0]] += n
        if runs and runs[-1][1] == n:
            runs[-1][2] += 1
        else:
            runs.append([r[0][-5:], n, 1, r[1].strip()[:48]])
    print(f"executed warp instructions {total}")
    print("by opcode:", ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
    print(f"{'address':>8} {'times':>6} {'instrs':>6} {'total':>8}  first instruction")
    for addr, n, k, first in runs:
        if n * k >= a.min_share * total:
            print(f"{addr:>8} {n:6d} {k:6d} {n * k:8d}  {first}")


if __name__ == "__main__":
    main()
