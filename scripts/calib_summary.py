"""Summarize sensitivity files: median R², a_l by layer type, Spearman between two runs, and
how much of a_l the noise levels carry: a_l refitted on every 2nd / 4th level (and the last
alone) against the fit on all of them, and against the other run's (another seed's) fit.

    python scripts/calib_summary.py sens_seed0.json [sens_seed1.json]
"""

import json
import statistics
import sys
from pathlib import Path

from scipy.stats import spearmanr

from qpalette.calibration.noise import fit_through_origin, noise_levels


def _agreement(a: list[float], b: list[float]) -> dict:
    return {"spearman": float(spearmanr(a, b).statistic),
            "median_abs_rel_diff": statistics.median(abs(x - y) / abs(y) for x, y in zip(a, b) if y)}


def level_subsets(doc: dict, other: dict | None = None) -> dict:
    """a_l refitted on subsets of the measured levels (every k-th, ending at the largest) against
    the fit on all levels, and against `other`'s all-level fit (another seed: the noise floor)."""
    n, key = doc["levels"], next(k for k in next(iter(doc["layers"].values())) if k.startswith("delta_"))
    ts = noise_levels(n, doc["t_max"])
    names = [m for m in doc["layers"] if other is None or m in other["layers"]]
    full = [doc["layers"][m]["a"] for m in names]
    out = {}
    for step in (2, 4, n):
        keep = list(range(step - 1, n, step))
        if len(keep) == n or not keep:
            continue
        a = [fit_through_origin([ts[i] for i in keep], [doc["layers"][m][key][i] for i in keep])[0] for m in names]
        row = {"levels": [i + 1 for i in keep], "vs_all_levels": _agreement(a, full)}
        if other is not None:
            row["vs_other_run"] = _agreement(a, [other["layers"][m]["a"] for m in names])
        out[f"{len(keep)}_levels"] = row
    return out


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
    if docs[0].get("levels", 0) > 1:
        out["level_subsets"] = level_subsets(docs[0], docs[1] if len(docs) == 2 else None)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
