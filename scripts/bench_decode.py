#!/usr/bin/env python3
"""Decode speed of a model and of compressed variants of it, side by side, resumable.

Variants: `fp16` (the model itself), each `--schemes` KEY=ENTRY (every layer and, unless
--no-lm-head, lm_head that palette entry: `compress --scheme ENTRY --lm-head`) and each `--plans` file (key: its name less
`plan_`). Each is compressed with random codes (speed does not depend on code values) into
--work, timed by `qpalette bench` with the same options as every other variant, written to
OUT/bench_KEY.json (a plan is copied to OUT/plan_KEY.json beside it), and its compressed copy is
deleted (--keep: left in W/q_KEY, e.g. for scripts/decode_breakdown.py). A variant whose
OUT/bench_KEY.json exists is skipped, so a run cut short by a time limit continues where it stopped.
OUT has the layout scripts/make_results.py reads.

    python scripts/bench_decode.py MODEL --work W --out OUT [--schemes 2bit=tcq-2.0,4bit=nuq-4]
        [--plans plan_speed230.json,...] [--batch-sizes 1,8] [--ways loop,generate] [--attention sdpa]
        [--keep]

MODEL: a local model folder, or synthetic:CONFIG (e.g. synthetic:llama-3.1-8b: random weights of
that model's shapes, made once into W/synthetic). Prints loop tok/s and the ratio to fp16.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from qpalette import api
from qpalette.errors import InputError, QpaletteError
from qpalette.fileio import read_json_object
from qpalette.measure.bench import ATTENTIONS


def variants(schemes: str, plans: str, lm_head: bool = True) -> dict[str, tuple[str | None, bool]]:
    """{key: (scheme or plan path, quantize lm_head)} in run order, fp16 first (plan_or_scheme
    None)."""
    out: dict[str, tuple[str | None, bool]] = {"fp16": (None, False)}
    for item in filter(None, schemes.split(",")):
        key, sep, entry = item.partition("=")
        if not sep or not key or not entry:
            raise InputError(f"--schemes {item!r}: write KEY=ENTRY, e.g. 2bit=tcq-2.0")
        out[key] = (entry, lm_head)
    for path in filter(None, plans.split(",")):
        if not Path(path).is_file():
            raise InputError(f"--plans: no plan file {path}")
        out[Path(path).stem.removeprefix("plan_")] = (path, False)
    return out


def source_model(model: str, work: Path) -> str:
    """The model folder to compress and time (a synthetic one is made once under work)."""
    if not model.startswith("synthetic:"):
        return model
    from qpalette.models.synthetic import make_synthetic_model

    folder = work / "synthetic"
    if not (folder / "config.json").is_file():
        make_synthetic_model(folder, config=model.removeprefix("synthetic:"))
    return str(folder)


def bench_variant(key: str, what: str | None, lm_head: bool, model: str, work: Path, out: Path,
                  bench_options: dict, keep: bool = False) -> dict:
    """Compress (random codes; a finished copy from a cut run is reused), time, write
    OUT/bench_KEY.json, delete the compressed copy unless `keep`."""
    target = model
    if what is not None:
        target = str(work / f"q_{key}")
        if not (work / f"q_{key}" / "qpalette-compress.json").is_file():  # a cut compress continues
            api.compress(model, what, target, random_codes=True, resume=True, quiet=True,
                         **({"lm_head": True} if lm_head else {}))
        if Path(what).is_file():
            shutil.copyfile(what, out / f"plan_{key}.json")
    result = api.bench(target, json_out=out / f"bench_{key}.json", **bench_options)
    if what is not None and not keep:
        shutil.rmtree(target)
    return result


def summary(out: Path, keys) -> list[str]:
    runs = {k: read_json_object(out / f"bench_{k}.json", "bench", InputError) for k in keys
            if (out / f"bench_{k}.json").is_file()}
    fp16 = {r["batch_size"]: r["loop_tok_per_s"] for r in runs.get("fp16", {}).get("rows", [])}
    lines = []
    for key, doc in runs.items():
        for r in doc["rows"]:
            base = fp16.get(r["batch_size"])
            ratio = f"{r['loop_tok_per_s'] / base:.2f}× fp16" if base else "–"
            lines.append(f"{key:>12} batch {r['batch_size']}: loop {r['loop_tok_per_s']:.1f} tok/s ({ratio})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--work", type=Path, required=True, help="folder for the compressed copies (and a synthetic model)")
    ap.add_argument("--out", type=Path, required=True, help="folder for bench_KEY.json and plan_KEY.json")
    ap.add_argument("--schemes", default="2bit=tcq-2.0,4bit=nuq-4", help="KEY=ENTRY pairs ('' for none)")
    ap.add_argument("--plans", default="", help="comma-separated plan files")
    ap.add_argument("--no-lm-head", action="store_true", help="--schemes variants keep lm_head 16-bit")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--ways", default="loop", help="of qpalette bench: decoder, generate, loop")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention", choices=ATTENTIONS, default="qpalette",
                    help="of qpalette bench: qpalette's decode attention or transformers' sdpa (every variant)")
    ap.add_argument("--keep", action="store_true", help="keep the compressed copies (WORK/q_KEY) after timing them")
    args = ap.parse_args(argv)
    try:
        todo = variants(args.schemes, args.plans, lm_head=not args.no_lm_head)
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except (InputError, ValueError) as e:
        ap.error(str(e))
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    options = {"batch_sizes": batch_sizes, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
               "ways": args.ways.split(","), "device": args.device, "attention": args.attention}
    try:
        model = source_model(args.model, args.work)
        for key, (what, lm_head) in todo.items():
            if (args.out / f"bench_{key}.json").is_file():
                print(f"{key}: measured already ({args.out / f'bench_{key}.json'})", flush=True)
                continue
            bench_variant(key, what, lm_head, model, args.work, args.out, options, keep=args.keep)
            print("\n".join(summary(args.out, [key])), flush=True)
    except QpaletteError as e:  # a user's mistake (unknown model or entry, bad plan): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(["== summary =="] + summary(args.out, todo)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
