#!/usr/bin/env python3
"""Quality sweep on SmolLM2-135M for docs/results.md, in one process on a GPU.

For each configuration: compress (uniform scheme, or a mixed-scheme plan made beforehand with
`qpalette plan`, since OR-Tools need not be where the GPU is), load the checkpoint through
transformers, and measure WikiText-2 perplexity (non-overlapping 2048-token windows) and the
data-free KL to the original (sequences sampled from the original). Also the original itself
and a plain round-to-nearest 4-bit group-128 baseline (no rotation, fake-quantized weights).
Predicted loss (docs/method.md §4: Σ a_l·err_l) comes from the sensitivity file and the distortion table.

    python3 scripts/sweep_smollm2.py --model DIR --text wikitext2_raw_test.txt \
        --sens results/calibrate_smollm2/sens_gpu_8k_seed0.json \
        --plans results/sweep_smollm2/plans --out results/sweep_smollm2/sweep.json \
        [--only tcq-3.0,msq-3.0] [--dtype float32|float16]

Writes the JSON after every configuration (a killed sweep keeps what it measured; --resume
skips configurations already in the file).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

UNIFORM = ["tcq-2.0", "tcq-2.5", "tcq-3.0", "tcq-3.5", "tcq-4.0",
           "nuq-2", "nuq-3", "nuq-4", "nuq-5",
           "vq-2.0", "vq-2.5", "vq-3.0", "vq-3.5", "vq-4.0"]


def predicted_loss(sens: dict, layers: dict[str, str]) -> float:
    from qpalette.quant.distortion import DistortionTable

    table = DistortionTable.load().rows
    return sum(max(v["a"], 0.0) * table[layers[n]].nmse for n, v in sens["layers"].items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--sens", required=True)
    ap.add_argument("--plans", type=Path, required=True, help="Folder of plan_msq_<B>bits.json files.")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qp_sweep"))
    ap.add_argument("--only", default=None, help="Comma list of configuration names.")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--kl-seqs", type=int, default=32)
    ap.add_argument("--kl-len", type=int, default=512)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--keep", default="", help="Comma list of configurations whose checkpoint to keep in --work.")
    args = ap.parse_args()

    import qpalette  # noqa: F401  (registers the checkpoint format)
    from qpalette.calibration.data import load_text as load_eval_text
    from qpalette.calibration.data import sample_model
    from qpalette.compression.writer import CompressOptions, compress
    from qpalette.fileio import atomic_write_json
    from qpalette.measure.evaluate import mean_kl, perplexity, tokenize
    from qpalette.models.sources import resolve_model
    from qpalette.models.topology import linear_layers, load_config
    from qpalette.quant.rtn import rtn_bits, rtn_fake_quantize
    from qpalette.runtime.loading import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    src = resolve_model(args.model)
    sens = json.loads(Path(args.sens).read_text())
    names = [l.name for l in linear_layers(load_config(src))]
    ref, tok = load_model(src, device, torch.float32)
    text, source = load_eval_text(text_file=args.text)
    ids = tokenize(tok, text)
    kl_tokens = sample_model(ref, tok, args.kl_seqs, args.kl_len, seed=0, device=device)

    configs: list[tuple[str, dict]] = [("fp", {"kind": "original"}), ("rtn4-g128", {"kind": "rtn"})]
    configs += [(s, {"kind": "uniform", "scheme": s}) for s in UNIFORM]
    for p in sorted(args.plans.glob("plan_msq_*bits.json")):
        b = p.stem.removeprefix("plan_msq_").removesuffix("bits")
        configs.append((f"msq-{b}", {"kind": "msq", "plan": p}))
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if c[0] in keep]
    done = json.loads(args.out.read_text())["rows"] if args.resume and args.out.exists() else []
    have = {r["name"] for r in done}

    def measure(model) -> dict:
        t0 = time.time()
        pp = perplexity(model, ids, ctx=args.ctx, device=device)
        kl = mean_kl(ref, model, kl_tokens, device=device)
        return {"ppl": pp.ppl, "windows": pp.windows, "kl": kl, "eval_s": round(time.time() - t0, 1)}

    for name, cfg in configs:
        if name in have:
            continue
        print(f"== {name}", flush=True)
        row = {"name": name, "kind": cfg["kind"], "dtype": args.dtype}
        if cfg["kind"] == "original":
            m = ref if dtype == torch.float32 else load_model(src, device, dtype)[0]
            row.update(avg_bits=16.0, predicted_loss=0.0, **measure(m))
        elif cfg["kind"] == "rtn":
            m, _ = load_model(src, device, torch.float32)
            bits = numel = 0
            with torch.no_grad():
                for n in names:
                    lin = m.get_submodule(n)
                    lin.weight.copy_(rtn_fake_quantize(lin.weight, 4, 128))
                    bits += lin.weight.numel() * rtn_bits(4, 128, lin.weight.shape[1])
                    numel += lin.weight.numel()
            row.update(avg_bits=bits / numel, predicted_loss=None, **measure(m.to(dtype)))
        else:
            out = args.work / name
            t0 = time.time()
            rep = compress(CompressOptions(model=str(src), output=out, scheme=cfg.get("scheme"),
                                           plan=cfg.get("plan"), overwrite=True, quiet=True),
                           log=lambda s: None)
            compress_s = time.time() - t0
            layers = {n: (cfg["scheme"] if cfg["kind"] == "uniform" else None) for n in names}
            if cfg["kind"] == "msq":
                layers = {n: v["quantizer"] for n, v in json.loads(Path(cfg["plan"]).read_text())["layers"].items()}
            m = qpalette.from_pretrained(out, device=device, dtype=dtype)
            row.update(family=cfg.get("scheme", "msq").split("-")[0] if cfg["kind"] == "uniform" else "msq",
                       avg_bits=rep["avg_bits"], bytes=rep["bytes"]["total"],
                       predicted_loss=predicted_loss(sens, layers), compress_s=round(compress_s, 1),
                       **measure(m))
            if name not in args.keep.split(","):
                shutil.rmtree(out, ignore_errors=True)
        del m
        torch.cuda.empty_cache() if device.type == "cuda" else None
        print(json.dumps(row), flush=True)
        done.append(row)
        atomic_write_json(args.out, {"format": "qpalette.sweep/1", "model": str(args.model),
                                     "text": source, "device": str(device), "rows": done})


if __name__ == "__main__":
    main()
