"""Summarize sensitivity files: median R², a_l by layer type, Spearman between two runs.

    python scripts/calib_summary.py sens_seed0.json [sens_seed1.json]
"""

import json
import statistics
import sys
from pathlib import Path

from scipy.stats import spearmanr


def main(paths):
    docs = [json.loads(Path(p).read_text()) for p in paths]
    out = {}
    for p, d in zip(paths, docs):
        L = d["layers"]
        r2 = [v["r2"] for v in L.values()]
        kinds = {}
        for n, v in L.items():
            kinds.setdefault(n.rsplit(".", 1)[-1], []).append(v["a"])
        out[p] = {"layers": len(L), "tokens": d["tokens"], "median_r2": statistics.median(r2),
                  "min_r2": min(r2), "frac_r2_ge_0.95": sum(x >= 0.95 for x in r2) / len(r2),
                  "total_s": d["timing"]["total_s"], "layers_s": d["timing"]["layers_s"],
                  "sampling_s": d["timing"]["sampling_s"],
                  "median_a_by_type": {k: statistics.median(v) for k, v in kinds.items()}}
    if len(docs) == 2:
        names = [n for n in docs[0]["layers"] if n in docs[1]["layers"]]
        a0 = [docs[0]["layers"][n]["a"] for n in names]
        a1 = [docs[1]["layers"][n]["a"] for n in names]
        out["spearman"] = float(spearmanr(a0, a1).statistic)
        out["median_abs_rel_diff"] = statistics.median(abs(x - y) / (0.5 * (x + y)) for x, y in zip(a0, a1))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
