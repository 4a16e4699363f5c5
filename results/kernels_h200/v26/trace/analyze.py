#!/usr/bin/env python3
"""A decode step's critical path from trace_step.py's CTA records (trace.diff), layer by layer:
    python analyze.py trace_b1.json.gz [--layers 32]
Each GEMV CTA stamped %globaltimer at its start (t0), past griddepcontrol.wait (t1), when its main
loop began (t2: staging and B fragments done) and at its end (t3). Each attention CTA stamped its
start, past the wait, q staged, the merge's start and end. The last of the recorded steps is read."""
import argparse
import gzip
import json
from statistics import mean, median

NAMES = {384: "qkv", 1792: "gateup", 8016: "lm_head"}


def gemv_name(r):
    tag = r[4]
    rt, cs = tag & 0xFFFFFF, (tag >> 28) & 0xF
    return NAMES.get(rt, "o" if cs == 1 else "down")


def gemv_launches(records, count):
    """The last `count` launches: CTA records sorted by start, a new launch where the shape changes."""
    out = []
    for r in sorted(records, key=lambda r: r[0]):
        if not out or out[-1][0] != gemv_name(r):
            out.append((gemv_name(r), []))
        out[-1][1].append(r)
    return out[-count:]


def attention_launches(records, t_from, t_to):
    """(CTA records, merge records) a launch, split where CTA starts are > 3 µs apart."""
    main = sorted((r for r in records if r[4] >> 60 == 2 and t_from < r[0] < t_to), key=lambda r: r[0])
    merges = [r for r in records if r[4] >> 60 == 3]
    out = []
    for r in main:
        if not out or r[0] - out[-1][-1][0] > 3000:
            out.append([])
        out[-1].append(r)
    return [(c, [m for m in merges if min(r[3] for r in c) <= m[0] <= max(r[3] for r in c) + 1000]) for c in out]


def gemv_row(ctas, prev_end):
    """µs from the predecessor's last CTA end: first CTA past the wait, median CTA past it; the
    medians of staging (t1 → t2) and main loop (t2 → t3); the launch's last end."""
    return {"first_past_wait": (min(r[1] for r in ctas) - prev_end) / 1e3,
            "median_past_wait": (median(r[1] for r in ctas) - prev_end) / 1e3,
            "staging": median(r[2] - r[1] for r in ctas) / 1e3,
            "main_loop": median(r[3] - r[2] for r in ctas) / 1e3,
            "last_end": (max(r[3] for r in ctas) - prev_end) / 1e3,
            "end_spread": (max(r[3] for r in ctas) - min(r[3] for r in ctas)) / 1e3,
            "late_ctas": sum(r[0] > prev_end for r in ctas)}


def attention_row(ctas, merges, prev_end):
    return {"first_past_wait": (min(r[1] for r in ctas) - prev_end) / 1e3,
            "median_past_wait": (median(r[1] for r in ctas) - prev_end) / 1e3,
            "q_staged": median(r[2] - r[1] for r in ctas) / 1e3,
            "key_blocks": median(r[3] - r[2] for r in ctas) / 1e3,
            "merge": median(m[3] - m[0] for m in merges) / 1e3 if merges else None,
            "last_end": (max(m[3] for m in merges) - prev_end) / 1e3 if merges else None}


def steady_state(d, layers):
    gl = gemv_launches([r for r in d["gemv"] if r[4] >> 60 == 1], 4 * layers + 1)
    t0, t1 = min(r[0] for r in gl[0][1]), max(r[3] for r in gl[-1][1])
    att = attention_launches(d["attention"], t0 - 20000, t1)
    rows = {k: [] for k in ("qkv", "attention", "o", "gateup", "down")}
    ai = 0
    for i in range(1, len(gl) - 1):
        name, ctas = gl[i]
        prev_end = max(r[3] for r in gl[i - 1][1])
        if name == "o" and d["batch"] == 1:  # after the attention, which follows q/k/v
            while ai < len(att) and min(r[0] for r in att[ai][0]) < prev_end - 20000:
                ai += 1
            if ai < len(att) and att[ai][1]:
                rows["attention"].append(attention_row(*att[ai], prev_end))
                prev_end = max(m[3] for m in att[ai][1])
        if i >= 4 and i < len(gl) - 4:  # layers 1 .. L−2
            rows[name].append(gemv_row(ctas, prev_end))
    return {k: {f: mean(r[f] for r in v) for f in v[0]} for k, v in rows.items() if v}, (t1 - t0) / 1e3


def warp_ends(d):
    """With trace_warps.diff (kind-4 records: warps 1–3 of each attention CTA): the median µs by which
    each warp's key loop ends after warp 0's, and how often each warp ends last."""
    w0 = {(r[0], r[4] >> 32 & 0xFFFFFFF, r[4] >> 16 & 0xFFFF): r[3] for r in d["attention"] if r[4] >> 60 == 2}
    lag, last = {}, {}
    per_cta = {}
    for r in d["attention"]:
        if r[4] >> 60 == 4 and (r[0], r[4] >> 32 & 0xFFFFFFF, r[4] >> 16 & 0xFFFF) in w0:
            key = (r[0], r[4] >> 32 & 0xFFFFFFF, r[4] >> 16 & 0xFFFF)
            lag.setdefault(r[4] & 0xF, []).append((r[3] - w0[key]) / 1e3)
            per_cta.setdefault(key, {0: w0[key]})[r[4] & 0xF] = r[3]
    for ends in per_cta.values():
        w = max(ends, key=ends.get)
        last[w] = last.get(w, 0) + 1
    return {w: median(v) for w, v in sorted(lag.items())}, last


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    d = json.load(gzip.open(a.trace) if a.trace.endswith(".gz") else open(a.trace))
    ss, span = steady_state(d, a.layers)
    print(f"batch {d['batch']}: first GEMV start to lm_head end {span:.1f} µs; CUDA-event steps "
          f"{[round(x, 4) for x in d['step_ms']]} ms; means over layers 1–{a.layers - 2}, µs from the predecessor's end")
    for k, v in ss.items():
        print(f"  {k:9s} " + "  ".join(f"{f} {x:.2f}" for f, x in v.items()))
    if any(r[4] >> 60 == 4 for r in d["attention"]):
        lags, last = warp_ends(d)
        print("  attention warps: key loop ends after warp 0's by (median µs)", {w: round(x, 2) for w, x in lags.items()},
              "; CTAs whose last warp is", last)
    print(json.dumps({"batch": d["batch"], "span_us": span, "steady_state": ss}))
