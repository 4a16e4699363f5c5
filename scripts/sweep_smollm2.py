#!/usr/bin/env python3
"""SmolLM2-135M quality sweep for docs/results.md: data-free and data-aware qpalette rows and
their peers, every row's perplexity measured by one function on the same windows.

Phases (each resumable; `collect` and `sweep` need a GPU for real runs, `plan` needs OR-Tools):

    collect  on the calibration text, each step a `qpalette` command, timed: `hessians`,
             `calibrate --loss ce` (the 'linear' loss term) and `loss-table --hessians` (the
             'actual' one). Hessians stay in WORK/hessians; the rest goes to --inputs and --out.
    plan     the data-aware MSQ plans the rows need, from --inputs, into --inputs/sweep_plans.json.
    sweep    every row in order: quantize (compress timed), load, perplexity over all
             --ctx-token windows of the evaluation text. The JSON (--out) is rewritten after every
             row and --resume skips the rows in it; a row that would end after --deadline is not
             started; a row whose plan cannot be made here (no OR-Tools) is skipped; a failing row
             is recorded under "failed" and the sweep goes on. Missing Hessians are collected first.

Rows (the default list is in priority order):
    fp                  the original, float16 on a GPU
    df-ENTRY, da-ENTRY  one palette entry for every layer, data-free / data-aware (LDLQ)
    df-msq-B            the data-free plans of the first sweep (--df-plans, KL sensitivities)
    da-msq-B            data-aware plan, 'linear' term (CE sensitivities), whole palette
    da-msq-lint-B       the same restricted to the loss table's entries
    da-msq-act-B        data-aware plan, 'actual' term (the loss table), the table's entries
    bnb-nf4[-dq], hqq-N-gG, rtn-N-gG   peers (scripts/sweep_peers.py)

    python3 scripts/sweep_smollm2.py collect --calib-text valid.txt --out OUT
    python3 scripts/sweep_smollm2.py plan --inputs OUT
    python3 scripts/sweep_smollm2.py sweep --eval-text test.txt --inputs OUT --out OUT/sweep.json --resume
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweep_peers import is_peer, load_peer  # noqa: E402

FORMAT = "qpalette.sweep/2"
PLANS_FORMAT = "qpalette.sweep-plans/1"
ROWS = ["fp", "da-msq-3.0", "da-msq-2.5", "da-msq-act-3.0", "da-msq-act-2.5", "da-msq-4.0",
        "bnb-nf4", "bnb-nf4-dq", "hqq-4-g64", "hqq-3-g64", "rtn-4-g128", "rtn-4-g64", "rtn-3-g64",
        "da-tcq-3.0", "df-tcq-3.0", "da-tcq-2.0", "df-msq-3.0", "df-msq-2.5", "df-msq-4.0", "df-tcq-2.0",
        "da-msq-lint-3.0", "da-msq-lint-2.5", "df-msq-3.5", "da-msq-3.5"]
TABLE_ENTRIES = "tcq-2.0,tcq-2.5,tcq-3.0,tcq-3.5,tcq-4.0,nuq-5,nuq-6"
MSQ = re.compile(r"^(?P<mode>df|da)-msq(?:-(?P<term>lint|act))?-(?P<bits>\d+\.\d+)$")
UNIFORM = re.compile(r"^(?P<mode>df|da)-(?P<entry>(?:half-)?(?:tcq|nuq|vq)-\d+(?:\.\d+)?)$")
GUESS_S = {"original": 20, "peer": 40, "data-free": 90, "data-aware": 180}  # before a row of the kind ran


class Skip(Exception):
    """A row that cannot run in this process (its plan cannot be made here)."""


def row_kind(name: str) -> str:
    if name == "fp":
        return "original"
    if is_peer(name):
        return "peer"
    m = MSQ.match(name) or UNIFORM.match(name)
    if m is None:
        raise SystemExit(f"unknown row '{name}'")
    return "data-aware" if m["mode"] == "da" else "data-free"


def plan_key(name: str) -> str | None:
    """'lin-3.0', 'lint-2.5', 'act-3.0' for a data-aware MSQ row, 'df-3.0' for a data-free one."""
    m = MSQ.match(name)
    if m is None:
        return None
    return f"df-{m['bits']}" if m["mode"] == "df" else f"{m['term'] or 'lin'}-{m['bits']}"


# --------------------------------------------------------------------------- running qpalette


def qpalette_cli(argv: list[str]) -> float:
    """Run `qpalette ARGV` in a fresh process (no state such as TF32 flags leaks between steps);
    its wall time in seconds."""
    code = "import sys; from qpalette.cli import app; sys.argv[0] = 'qpalette'; app()"
    print("$ qpalette " + " ".join(argv), flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *argv], check=True)
    return round(time.perf_counter() - t0, 2)


def ensure_hessians(args) -> float | None:
    """Collect the Hessians into WORK/hessians unless a finished run is there; its seconds."""
    from qpalette.calibration.hessian_files import MANIFEST

    hess = args.work / "hessians"
    if (hess / MANIFEST).is_file():
        return None
    return qpalette_cli(["hessians", args.model, "--text-file", str(args.calib_text), "-o", str(hess),
                         "--tokens", str(args.hessian_tokens), "--resume", "-q"])


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, doc) -> None:
    from qpalette.fileio import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, doc)


# --------------------------------------------------------------------------- collect


def collect(args) -> None:
    inputs = args.inputs
    record = read_json(inputs / "collect.json") or {"format": "qpalette.sweep-collect/1", "steps": {}}
    record["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    steps = [("hessians", lambda: ensure_hessians(args), args.work / "hessians" / "hessians.json"),
             ("sensitivity", lambda: qpalette_cli(
                 ["calibrate", args.model, "--text-file", str(args.calib_text), "--loss", "ce",
                  "-n", str(args.sens_seqs), "--seq-len", str(args.sens_seq_len), "--levels", str(args.sens_levels),
                  "-o", str(inputs / "sens_ce.json"), "--resume", "-q"]), inputs / "sens_ce.json"),
             ("loss_table", lambda: qpalette_cli(
                 ["loss-table", args.model, "--text-file", str(args.calib_text), "--hessians",
                  str(args.work / "hessians"), "--entries", args.table_entries, "--tokens", str(args.table_tokens), "--seq-len", str(args.table_seq_len),
                  "--layers", r"model\.layers\.", "-o", str(inputs / "loss_table.json"), "--resume", "-q"]
                 + (["--base", args.table_base] if args.table_base else [])), inputs / "loss_table.json")]
    for key, run, output in steps:
        if key in record["steps"] and output.is_file():
            print(f"-- {key}: done before ({record['steps'][key]['seconds']} s)", flush=True)
            continue
        seconds = run()
        record["steps"][key] = {"seconds": seconds, **inner_timing(key, output)}
        print(f"== {key}: {seconds} s", flush=True)
        write_json(inputs / "collect.json", record)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for f in ("collect.json", "sens_ce.json", "loss_table.json"):
            shutil.copy(inputs / f, args.out / f)


def inner_timing(key: str, output: Path) -> dict:
    """What the step's own output says about its run (tokens, its own seconds)."""
    doc = read_json(output) or {}
    if key == "hessians":
        return {"tokens": doc.get("tokens"), "run_s": doc.get("seconds"), "device": doc.get("device")}
    if key == "sensitivity":
        return {"tokens": doc.get("tokens"), "run_s": doc.get("timing", {}).get("total_s"),
                "median_r2": doc.get("median_r2")}
    return {"tokens": doc.get("tokens"), "run_s": doc.get("timing", {}).get("seconds"),
            "entries": doc.get("entries"), "base": doc.get("base"),
            "cells": sum(len(r) for r in doc.get("rows", {}).values())}


# --------------------------------------------------------------------------- plans


def plan_file(args, key: str, make: bool) -> Path:
    """The plan file of `key` (made into --inputs/sweep_plans.json first when missing and `make`)."""
    if key.startswith("df-"):
        path = args.df_plans / f"plan_msq_{key[3:]}bits.json"
        if not path.is_file():
            raise Skip(f"no data-free plan {path}")
        return path
    bundle = args.inputs / "sweep_plans.json"
    plans = (read_json(bundle) or {"format": PLANS_FORMAT, "plans": {}})["plans"]
    if key not in plans:
        if not make:
            raise Skip(f"plan {key} not made yet")
        plans[key] = make_plan(args, key)
        write_json(bundle, {"format": PLANS_FORMAT, "plans": plans})
    path = args.work / "plans" / f"plan_{key}bits.json"
    write_json(path, plans[key])
    return path


def make_plan(args, key: str) -> dict:
    """A data-aware plan: 'lin' CE sensitivities, whole palette; 'lint' the same on the loss
    table's entries; 'act' the loss table itself. Needs OR-Tools (else Skip)."""
    try:
        import ortools  # noqa: F401
    except ImportError:
        raise Skip("OR-Tools is not installed here: run the plan phase where it is") from None
    from qpalette import plan

    term, bits = key.split("-")
    sens, table = args.inputs / "sens_ce.json", args.inputs / "loss_table.json"
    for f in (sens, table) if term != "lin" else (sens,):
        if not f.is_file():
            raise Skip(f"{f} is missing: run the collect phase")
    entries = read_json(table)["entries"] if term != "lin" else None
    t0 = time.perf_counter()
    p = plan(None, f"{bits}bits", sensitivity=sens, palette=entries, time_limit_s=args.plan_time_limit,
             loss_table=table if term == "act" else None)
    print(f"== plan {key}: {time.perf_counter() - t0:.1f} s, predicted loss {p.totals['predicted_loss']:.4f}",
          flush=True)
    return p.to_dict()


def make_plans(args) -> None:
    for key in dict.fromkeys(plan_key(r) for r in args.rows.split(",")):
        if key and not key.startswith("df-"):
            plan_file(args, key, make=True)


# --------------------------------------------------------------------------- sweep


def sweep(args) -> None:
    from transformers import AutoTokenizer

    from qpalette.calibration.data import load_text
    from qpalette.measure.evaluate import tokenize
    from qpalette.models.sources import resolve_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    src = resolve_model(args.model, quiet=True)
    tok = AutoTokenizer.from_pretrained(str(src))
    text, source = load_text(text_file=args.eval_text)
    ids = tokenize(tok, text)
    doc = read_json(args.out) if args.resume else None
    doc = doc or {"format": FORMAT, "model": args.model, "text": source, "device": device_name(device),
                  "dtype": str(dtype).removeprefix("torch."), "ctx": args.ctx, "eval_batch": args.eval_batch,
                  "rows": [], "failed": [], "hessians_s": []}
    done = {r["name"] for r in doc["rows"]}
    for name in args.rows.split(","):
        kind = row_kind(name)
        if name in done:
            continue
        est = estimate(doc, kind)
        if args.deadline and time.time() + est > args.deadline:
            print(f"-- {name}: not started (about {est:.0f} s; the deadline is in "
                  f"{args.deadline - time.time():.0f} s)", flush=True)
            continue
        try:
            row = measure_row(args, name, kind, src, ids, device, dtype, doc)
        except Skip as e:
            print(f"-- {name}: skipped ({e})", flush=True)
            continue
        except Exception as e:  # noqa: BLE001 — one broken row must not cost the others
            traceback.print_exc()
            doc["failed"].append({"name": name, "error": f"{type(e).__name__}: {e}"[:500]})
            write_json(args.out, doc)
            continue
        finally:
            torch.cuda.empty_cache() if device.type == "cuda" else None
        print(f"== {name}: ppl {row['ppl']:.3f}, {row['bits']:.3f} bits, {row['total_s']} s", flush=True)
        doc["rows"].append(row)
        doc["failed"] = [f for f in doc["failed"] if f["name"] != name]
        write_json(args.out, doc)
    bundle = args.inputs / "sweep_plans.json"
    if bundle.is_file() and args.out.parent.resolve() != args.inputs.resolve():
        shutil.copy(bundle, args.out.parent / "sweep_plans.json")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def estimate(doc: dict, kind: str) -> float:
    """Seconds a row of `kind` will take: the slowest such row so far, else a guess."""
    seen = [r["total_s"] for r in doc["rows"] if r["kind"] == kind]
    return max(seen) if seen else GUESS_S[kind]


def measure_row(args, name: str, kind: str, src: Path, ids: torch.Tensor, device, dtype, doc: dict) -> dict:
    """Quantize (or load) the row's model, time it, measure its perplexity."""
    from qpalette.runtime.loading import load_model

    t0 = time.perf_counter()
    row = {"name": name, "kind": kind}
    if kind == "original":
        model, _ = load_model(src, device, dtype, tokenizer=False)
        row.update(method="fp16" if dtype == torch.float16 else "float32", bits=16.0)
    elif kind == "peer":
        model, bits, notes = load_peer(name, src, device, dtype)
        row.update(method=name.split("-")[0], bits=bits, quantize_s=round(time.perf_counter() - t0, 2), notes=notes)
    else:
        model = compressed(args, name, kind, src, device, dtype, row, doc)
    row.update(evaluate(model, ids, args, device))
    del model
    row["total_s"] = round(time.perf_counter() - t0, 2)
    return row


def compressed(args, name: str, kind: str, src: Path, device, dtype, row: dict, doc: dict):
    """Compress the row's scheme or plan (data-aware: with the Hessians), record its time and
    stored bits, and load the checkpoint."""
    import qpalette
    from qpalette.models.topology import linear_layers, load_config

    key = plan_key(name)
    what = plan_file(args, key, make=True) if key else UNIFORM.match(name)["entry"]
    hessians = None
    if kind == "data-aware":
        seconds = ensure_hessians(args)
        if seconds is not None:
            doc["hessians_s"].append(seconds)
        hessians = args.work / "hessians"
    out = args.work / "ckpt" / name
    t0 = time.perf_counter()
    rep = qpalette.compress(str(src), what, out, overwrite=True, quiet=True, hessians=hessians)
    compress_s = round(time.perf_counter() - t0, 2)
    layers = linear_layers(load_config(src))
    b = rep["bytes"]
    row.update(method="msq" if key else "uniform", loss_term=loss_term(key), nominal_bits=rep["avg_bits"],
               bits=8 * (b["codes_and_row_scales"] + b["sign_vectors"] + b["codebooks"]) / sum(l.numel for l in layers),
               compress_s=compress_s, entries=entry_counts(what) if key else {what: len(layers)})
    model = qpalette.from_pretrained(out, device=device, dtype=dtype)
    shutil.rmtree(out, ignore_errors=True)  # loaded: the files are no longer needed
    return model


def loss_term(key: str | None) -> str | None:
    if key is None:
        return None
    return {"df": "linear (data-free KL)", "lin": "linear", "lint": "linear", "act": "actual"}[key.split("-")[0]]


def entry_counts(plan_path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for layer in read_json(plan_path)["layers"].values():
        counts[layer["quantizer"]] = counts.get(layer["quantizer"], 0) + 1
    return dict(sorted(counts.items()))


def evaluate(model, ids: torch.Tensor, args, device) -> dict:
    """The one perplexity of every row: non-overlapping --ctx windows, --eval-batch at a time."""
    from qpalette.measure.evaluate import perplexity

    t0 = time.perf_counter()
    pp = perplexity(model, ids, ctx=args.ctx, batch_size=args.eval_batch, max_windows=args.max_windows,
                    device=device)
    return {"ppl": pp.ppl, "nll": pp.nll, "windows": pp.windows, "windows_total": pp.windows_total,
            "eval_s": round(time.perf_counter() - t0, 2)}


# --------------------------------------------------------------------------- command line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["collect", "plan", "sweep"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qp_sweep"), help="Hessians, plans, checkpoints.")
    ap.add_argument("--inputs", type=Path, default=None,
                    help="collect's outputs and the plans bundle (default WORK/collect).")
    ap.add_argument("--out", type=Path, default=None, help="collect: a folder to copy its outputs to; sweep: the JSON.")
    ap.add_argument("--calib-text", type=Path, help="Calibration text (Hessians, sensitivities, loss table).")
    ap.add_argument("--eval-text", type=Path, help="Evaluation text (perplexity).")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--hessian-tokens", type=int, default=128 * 2048)
    ap.add_argument("--sens-seqs", type=int, default=8)
    ap.add_argument("--sens-seq-len", type=int, default=2048)
    ap.add_argument("--sens-levels", type=int, default=8)
    ap.add_argument("--table-entries", default=TABLE_ENTRIES)
    ap.add_argument("--table-tokens", type=int, default=8 * 2048)
    ap.add_argument("--table-seq-len", type=int, default=2048)
    ap.add_argument("--table-base", default=None, help="loss-table --base ENTRY (the paper's baseline).")
    ap.add_argument("--df-plans", type=Path, default=ROOT / "results" / "sweep_smollm2" / "plans")
    ap.add_argument("--plan-time-limit", type=float, default=60.0)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--eval-batch", type=int, default=4)
    ap.add_argument("--max-windows", type=int, default=None, help="Fewer windows (dry runs only).")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time after which no row may end.")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    args.inputs = args.inputs or args.work / "collect"
    import qpalette  # noqa: F401  (registers the checkpoint format with transformers)

    if args.phase == "collect":
        if not args.calib_text:
            ap.error("collect needs --calib-text")
        collect(args)
    elif args.phase == "plan":
        make_plans(args)
    else:
        if not (args.eval_text and args.out):
            ap.error("sweep needs --eval-text and --out")
        if not args.calib_text and any(row_kind(r) == "data-aware" for r in args.rows.split(",")):
            ap.error("data-aware rows need --calib-text (for the Hessians, if they are not in WORK yet)")
        sweep(args)


if __name__ == "__main__":
    main()
