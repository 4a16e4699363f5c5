"""a_l refitted on subsets of the levels of two 16-level SmolLM2 calibrations, and 3.0-bit plans
from them: how many noise levels `qpalette calibrate` needs (results/calibrate_smollm2/levels.md).
A run with --levels L measures t = i/L, i.e. levels 16i/L of the 16-level files, with the same
noise direction and tokens, so the refits are what shorter runs give.

    python scripts/refit_levels.py [OUT_DIR]   # default ./refit_levels → OUT_DIR/out.json
"""
import json
import os
import statistics
import sys

import numpy as np
from scipy.stats import spearmanr

import qpalette
from qpalette.calibration.noise import fit_through_origin, noise_levels

R = "results/calibrate_smollm2/"
OUT = sys.argv[1] if len(sys.argv) > 1 else "refit_levels"
os.makedirs(OUT, exist_ok=True)
docs = [json.load(open(R + f"sens_gpu_8k_seed{s}.json")) for s in (0, 1)]
names = list(docs[0]["layers"])
assert names == list(docs[1]["layers"])
SUBSETS = {"16": list(range(1, 17)), "4,8,12,16": [4, 8, 12, 16], "8,16": [8, 16], "16 alone": [16]}

def fit(doc, levels):
    ts = noise_levels(doc["levels"], doc["t_max"])
    out = {m: fit_through_origin([ts[i - 1] for i in levels], [doc["layers"][m]["delta_kl"][i - 1] for i in levels])
           for m in names}
    return [out[m][0] for m in names], [out[m][1] for m in names]

def rel(a, b):  # |a-b|/|b| per layer, as scripts/calib_summary.py
    return np.array([abs(x - y) / abs(y) for x, y in zip(a, b) if y])

fits = {(s, k): fit(docs[s], v) for s in (0, 1) for k, v in SUBSETS.items()}
for s in (0, 1):  # the stored a is the 16-level fit
    assert np.allclose(fits[(s, "16")][0], [docs[s]["layers"][m]["a"] for m in names], rtol=1e-9)
res = {"fits": {}, "plans": {}}
print("seed subset | same-run 16: spearman median p95 max | other seed 16: spearman median | median R2")
for (s, k), (a, r2) in fits.items():
    full, other = fits[(s, "16")][0], fits[(1 - s, "16")][0]
    r, ro = rel(a, full), rel(a, other)
    row = {"spearman_same": spearmanr(a, full).statistic, "median_same": float(np.median(r)),
           "p95_same": float(np.percentile(r, 95)), "max_same": float(r.max()),
           "spearman_other": spearmanr(a, other).statistic, "median_other": float(np.median(ro)),
           "median_r2": statistics.median(r2), "min_r2": min(r2), "negative_a": sum(x < 0 for x in a)}
    res["fits"][f"seed{s} {k}"] = row
    print(s, k, " ".join(f"{x:.5g}" for x in row.values()))

# plans from seed 0's coefficients (16, 4, 2 levels)
a0 = {m: max(x, 0.0) for m, x in zip(names, fits[(0, "16")][0])}
a1 = {m: max(x, 0.0) for m, x in zip(names, fits[(1, "16")][0])}
assign = {}
for k in ("16", "4,8,12,16", "8,16"):
    doc = json.loads(json.dumps(docs[0]))
    for m, x, r2 in zip(names, *fits[(0, k)]):
        doc["layers"][m].update(a=x, r2=r2)
    path = f"{OUT}/sens_seed0_{k.replace(',', '_')}.json"
    json.dump(doc, open(path, "w"))
    p = qpalette.plan("smollm2-135m", "3.0bits", sensitivity=path, palette=["nuq", "vq", "tcq", "half-tcq"],
                      output=f"{OUT}/plan_{k.replace(',', '_')}.json")
    assign[k] = {m: L.quantizer for m, L in p.layers.items()}
    row = {"layers": len(p.layers), "avg_bits": p.totals["avg_bits"], "own_predicted_loss": p.totals["predicted_loss"],
           "loss_a0_16": sum(a0[m] * L.err for m, L in p.layers.items()),
           "loss_a1_16": sum(a1[m] * L.err for m, L in p.layers.items()),
           "same_as_16": sum(assign[k][m] == assign["16"][m] for m in assign[k]),
           "solver": p.solver}
    res["plans"][k] = row
    print("plan", k, row)
json.dump(res, open(f"{OUT}/out.json", "w"), indent=1, default=str)
# noise floor: seed 1's 16-level plan, and the worst 2-level layers
p = qpalette.plan("smollm2-135m", "3.0bits", sensitivity=R + "sens_gpu_8k_seed1.json", palette=["nuq", "vq", "tcq", "half-tcq"])
print("plan seed1-16: same as seed0-16", sum(L.quantizer == assign["16"][m] for m, L in p.layers.items()),
      "loss a0", sum(a0[m] * L.err for m, L in p.layers.items()), "loss a1", sum(a1[m] * L.err for m, L in p.layers.items()))
for s in (0, 1):
    a2, full = fits[(s, "8,16")][0], fits[(s, "16")][0]
    worst = sorted(range(len(names)), key=lambda i: -abs(a2[i] - full[i]) / abs(full[i]))[:3]
    print("seed", s, [(names[i], round(a2[i] / full[i] - 1, 3), round(docs[s]["layers"][names[i]]["r2"], 3), round(full[i], 4)) for i in worst])
changed = [m for m in names if assign["8,16"][m] != assign["16"][m]]
print("changed by 2-level plan:", [(m, assign["16"][m], assign["8,16"][m]) for m in changed])
