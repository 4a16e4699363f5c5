#!/usr/bin/env python3
"""Which CTAs set a GEMV launch's end: those that started after the previous GEMV ended ("late") or
the others, and how long each kind took from its start to past griddepcontrol.wait (medians over the
last step's launches of each name): python late.py trace_b1.json.gz [--layers 32]"""
import argparse
import gzip
import json
from statistics import median

from analyze import gemv_launches

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--layers", type=int, default=32)
a = ap.parse_args()
d = json.load(gzip.open(a.trace) if a.trace.endswith(".gz") else open(a.trace))
gl = gemv_launches([r for r in d["gemv"] if r[4] >> 60 == 1], 4 * a.layers + 1)
rows = {}
for (_, prev), (name, ctas) in zip(gl, gl[1:]):
    prev_end = max(r[3] for r in prev)
    late = [r for r in ctas if r[0] > prev_end]
    early = [r for r in ctas if r[0] <= prev_end]
    if not late or not early:
        continue
    rows.setdefault(name, []).append((
        len(late), median(r[1] - r[0] for r in late) / 1e3, median(r[1] - r[0] for r in early) / 1e3,
        (max(r[3] for r in late) - prev_end) / 1e3, (max(r[3] for r in early) - prev_end) / 1e3))
print(f"batch {d['batch']} (µs; the previous GEMV, not the kernels between, is the reference)")
for name, rs in rows.items():
    m = [median(r[j] for r in rs) for j in range(5)]
    print(f"  {name:8s} late CTAs {m[0]:4.0f}: start → past the wait {m[1]:.2f} (early CTAs {m[2]:.2f}); "
          f"last end {m[3]:.2f} (early CTAs {m[4]:.2f})")
