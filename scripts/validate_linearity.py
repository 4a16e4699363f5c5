"""Check the linearity theorem on a real model: predicted Σ a_l·err_l vs measured ΔKL.

For each random mix, a random subset of the decoder's linear layers is replaced by simulated
quantized weights (incoherence rotation → palette entry → dequantize → unrotate), the nmse
err_l of each replaced layer is measured, and the KL of the mixed model from the original one is
measured on a held-out evaluation set (fresh model samples, another seed than calibration).

    python scripts/validate_linearity.py --model DIR --sens sens.json [--sens sens_seed1.json] \
        --mixes 12 --device cuda --out validation.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scipy.stats import spearmanr  # noqa: E402

from qpalette.calibration.data import bos_token_id, sample_tokens  # noqa: E402
from qpalette.calibration.evaluator import BlockEvaluator, linear_layers, ref_cache_budget  # noqa: E402
from qpalette.devices import resolve_dtype  # noqa: E402
from qpalette.models.sources import resolve_model  # noqa: E402
from qpalette.quant.incoherence import random_signs, rotate_weight, unrotate_weight  # noqa: E402
from qpalette.quant.palette import get_quantizer  # noqa: E402
from qpalette.runtime.loading import load_model  # noqa: E402

DEFAULT_ENTRIES = ["nuq-3", "nuq-4", "nuq-5", "vq-2.0", "vq-2.5", "vq-3.0", "vq-4.0", "tcq-2.0", "tcq-3.0"]


def pearson(x, y):
    mx, my = sum(x) / len(x), sum(y) / len(y)
    c = sum((a - mx) * (b - my) for a, b in zip(x, y))
    vx = math.sqrt(sum((a - mx) ** 2 for a in x))
    vy = math.sqrt(sum((b - my) ** 2 for b in y))
    return c / (vx * vy) if vx and vy else 0.0


def median(v):
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sens", action="append", required=True, help="calibrate JSON (repeatable)")
    ap.add_argument("--mixes", type=int, default=12)
    ap.add_argument("--entries", default=",".join(DEFAULT_ENTRIES))
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=777)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    t0 = time.perf_counter()
    model, tok = load_model(resolve_model(args.model), dev, resolve_dtype(args.dtype, dev, auto_cuda="tf32"))
    sens = [json.loads(Path(p).read_text()) for p in args.sens]
    layers = [(n, m) for n, m, _b in linear_layers(model) if all(n in s["layers"] for s in sens)]
    tokens = sample_tokens(model, args.num_seqs, args.seq_len, args.seed, args.num_seqs,
                           bos_token_id(tok, model.config), dev)
    ev = BlockEvaluator(model, tokens, args.batch_size, dev, ref_cache_budget(dev))
    ev.prepare()
    entries = []
    for name in args.entries.split(","):
        q = get_quantizer(name.strip())
        try:  # drop entries that cannot run here (codebooks missing, shape unsupported...)
            w = torch.randn(32, 64, device=dev)
            q.dequantize(q.quantize(w))
            entries.append(q)
        except Exception as e:  # noqa: BLE001
            print(f"skipping {q.name}: {type(e).__name__}: {e}", flush=True)
    print(f"setup {time.perf_counter() - t0:.1f}s; {len(layers)} layers; entries "
          f"{[q.name for q in entries]}", flush=True)

    cache: dict[tuple[str, str], tuple[torch.Tensor, float]] = {}
    originals = {n: m.weight.detach().clone() for n, m in layers}

    def simulated(k: int, name: str, mod, q) -> tuple[torch.Tensor, float]:
        key = (name, q.name)
        if key not in cache:
            w = originals[name].float()
            s = random_signs(w.shape[1], 1000 + k)
            w_hat = unrotate_weight(q.dequantize(q.quantize(rotate_weight(w, s))), s)
            err = float((w_hat - w).pow(2).sum() / w.pow(2).sum())
            cache[key] = (w_hat.to(originals[name].dtype), err)
        return cache[key]

    rng = random.Random(args.seed)
    fractions = [0.1, 0.25, 0.5, 0.75, 1.0]
    mixes = []
    for k in range(args.mixes):
        tm = time.perf_counter()
        frac = fractions[k % len(fractions)]
        # some mixes at a single low/high bit level, most with random entries per layer
        chosen = [(i, n, m) for i, (n, m) in enumerate(layers) if rng.random() < frac]
        if not chosen:
            chosen = [(0, *layers[0])]
        picks = {}
        for i, n, m in chosen:
            q = rng.choice(entries)
            w_hat, err = simulated(i, n, m, q)
            with torch.no_grad():
                m.weight.copy_(w_hat)
            picks[n] = (q.name, err)
        measured = ev.mean_kl()
        with torch.no_grad():
            for _i, n, m in chosen:
                m.weight.copy_(originals[n])
        preds = [sum(s["layers"][n]["a"] * e for n, (_q, e) in picks.items()) for s in sens]
        mixes.append({"fraction": frac, "n_layers": len(picks), "measured_kl": measured,
                      "predicted_kl": preds, "entries": {n: q for n, (q, _e) in picks.items()},
                      "seconds": round(time.perf_counter() - tm, 2)})
        print(f"mix {k:2d}: {len(picks):3d} layers  measured {measured:.5f}  predicted "
              + " ".join(f"{p:.5f}" for p in preds) + f"  ({mixes[-1]['seconds']} s)", flush=True)
    # sanity: the restored model has zero KL
    restored = ev.mean_kl()
    meas = [m["measured_kl"] for m in mixes]
    summary = []
    for j, path in enumerate(args.sens):
        pred = [m["predicted_kl"][j] for m in mixes]
        ratios = [a / b for a, b in zip(meas, pred) if b > 0]
        summary.append({
            "sensitivity": str(path),
            "pearson": pearson(pred, meas),
            "pearson_log": pearson([math.log(p) for p in pred], [math.log(max(m, 1e-12)) for m in meas]),
            "spearman": float(spearmanr(pred, meas).statistic),
            "median_ratio_measured_over_predicted": median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
        })
        print(json.dumps(summary[-1]), flush=True)
    doc = {"model": args.model, "eval_tokens": tokens.numel(), "eval_seed": args.seed,
           "restored_kl": restored, "entries": [q.name for q in entries], "summary": summary,
           "mixes": mixes, "seconds": round(time.perf_counter() - t0, 1)}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"restored-model KL {restored:.3g}; wrote {args.out} in {doc['seconds']} s")


if __name__ == "__main__":
    main()
