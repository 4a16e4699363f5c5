"""Medians over chains 10..39 of pdledge.py's kernel records (gate/up GEMV, rotation, down GEMV):
the rotation's own span, its start after gate/up's end, and down's start after the rotation's end.

    python spans.py   (in this folder)
"""
import json
import statistics as st

for tree in ("base", "gc"):
    for rows in (8, 1):
        d = json.load(open(f"pdledge_{tree}_m{rows}.json"))
        for key in ("pdl1", "pdl0"):
            chains = [d[key][i:i + 3] for i in range(0, len(d[key]) - 2, 3)][10:40]
            med = lambda f: st.median(f(c) for c in chains)  # noqa: E731
            print(f"{tree:4} rows {rows} {key}: rotation {med(lambda c: c[1][1] - c[1][0]):5.2f} us, "
                  f"starts {med(lambda c: c[1][0] - c[0][1]):5.2f} after gate/up ends, "
                  f"down starts {med(lambda c: c[2][0] - c[1][1]):5.2f} after it ends")
