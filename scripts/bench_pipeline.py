#!/usr/bin/env python3
"""Wall time and peak GPU memory of calibrate → plan → compress on one model, on given devices.

Each step runs as the `qpalette` command (a child process), so its time is what a user waits,
process start, model load and CUDA set-up included; the peak GPU memory of each GPU is sampled
by nvidia-smi every 0.2 s while a step runs (what the processes hold, CUDA context included).

    python scripts/bench_pipeline.py MODEL_DIR --work W --devices cuda:0 --budget 3.0bits
    python scripts/bench_pipeline.py MODEL_DIR --work W2 --devices cuda:0,cuda:1 --budget 3.0bits

Calibration at full size takes hours on an 8B model; `--num-seqs`/`--layers` measure a part and
the result carries a projection to the whole model (`--project-blocks`, `--project-seqs`): the
seconds of a layer of block b grow linearly with the blocks it runs (b..B−1), so a least-squares
line through the measured layers gives the projected total. A projection is labelled as one.
Prints a summary and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


class GpuMemorySampler:
    """Peak used memory (bytes) of each GPU while it runs, from nvidia-smi."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.peaks, self._stop = period_s, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in text.strip().splitlines():
                idx, mib = (int(v) for v in line.split(","))
                self.peaks[idx] = max(self.peaks.get(idx, 0), mib << 20)
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_step(name: str, args: list[str], log: Path) -> dict:
    """`qpalette ARGS`, timed, its GPU memory sampled; its output into `log`."""
    cmd = [sys.executable, "-m", "qpalette", *args]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with GpuMemorySampler() as mem, log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if rc:
        sys.exit(f"{name} failed (exit {rc}); see {log}:\n" + log.read_text()[-3000:])
    print(f"   {seconds:.1f} s, peak GPU memory {[round(v / 2**30, 2) for v in mem.peaks.values()]} GiB", flush=True)
    return {"command": "qpalette " + " ".join(args), "wall_s": round(seconds, 2),
            "peak_gpu_bytes": {str(k): v for k, v in sorted(mem.peaks.items())}}


def project_calibration(sens: dict, blocks: int, project_blocks: int, layers_per_block: int,
                        seqs_factor: float) -> dict:
    """Seconds of a whole calibration: s(layer of block b) ≈ c0 + c1·(B − b) fitted on the
    measured layers, summed over `layers_per_block` layers of each of `project_blocks` blocks
    plus the head, times the ratio of evaluation sequences."""
    import numpy as np

    rows = []
    for name, layer in sens["layers"].items():
        b = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else blocks
        rows.append((blocks - b, layer["seconds"]))
    x, y = np.array(rows, dtype=float).T
    design = np.stack([np.ones_like(x), x], axis=1)
    (c0, c1), *_ = np.linalg.lstsq(design, y, rcond=None)
    per_block = sum(c0 + c1 * (project_blocks - b) for b in range(project_blocks)) * layers_per_block
    total = (per_block + c0) * seqs_factor
    return {"fit_s_per_layer": {"constant": round(float(c0), 4), "per_block_run": round(float(c1), 4)},
            "measured_layers": len(rows), "projected_blocks": project_blocks, "seqs_factor": seqs_factor,
            "projected_layers_s": round(float(total), 1), "note": "projection from a measured part, not a run"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a local Hugging Face model folder")
    ap.add_argument("--work", type=Path, required=True, help="folder for the step outputs")
    ap.add_argument("--devices", default="cuda:0", help="the --device of calibrate and compress")
    ap.add_argument("--budget", default="3.0bits")
    ap.add_argument("--num-seqs", type=int, default=256, help="calibrate's evaluation sequences")
    ap.add_argument("--layers", default=None, help="calibrate only the layers matching this regex")
    ap.add_argument("--levels", type=int, default=None, help="calibrate's --levels (default: its own)")
    ap.add_argument("--sensitivity", type=Path, default=None,
                    help="plan from this sensitivity file instead of the calibration's (skips nothing)")
    ap.add_argument("--max-memory", default=None, help="calibrate's --max-memory (per device)")
    ap.add_argument("--project-blocks", type=int, default=None, help="project calibrate to this many blocks")
    ap.add_argument("--project-seqs", type=int, default=256, help="… and this many sequences")
    ap.add_argument("--steps", default="calibrate,plan,compress")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    steps, result = args.steps.split(","), {"model": args.model, "devices": args.devices, "steps": {}}
    sens = args.work / "sens.json"
    if "calibrate" in steps:
        cmd = ["calibrate", args.model, "-o", str(sens), "--device", args.devices, "-n", str(args.num_seqs), "-q"]
        cmd += ["--layers", args.layers] if args.layers else []
        cmd += ["--levels", str(args.levels)] if args.levels else []
        cmd += ["--max-memory", args.max_memory] if args.max_memory else []
        result["steps"]["calibrate"] = run_step("calibrate", cmd, args.work / "calibrate.log")
        doc = json.loads(sens.read_text())
        result["steps"]["calibrate"]["timing"] = doc["timing"]
        if args.project_blocks:
            blocks = json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"]
            per_block = len([n for n in doc["layers"] if n.startswith("model.layers.0.")]) or 7
            result["steps"]["calibrate"]["projection"] = project_calibration(
                doc, blocks, args.project_blocks, per_block, args.project_seqs / args.num_seqs)
    plan = args.work / "plan.json"
    if "plan" in steps:
        cmd = ["plan", args.model, "--budget", args.budget, "--sensitivity", str(args.sensitivity or sens),
               "-o", str(plan), "--no-plot"]
        result["steps"]["plan"] = run_step("plan", cmd, args.work / "plan.log")
    if "compress" in steps:
        out = args.work / "compressed"
        cmd = ["compress", args.model, "--plan", str(plan), "-o", str(out), "--device", args.devices, "-q",
               "--overwrite"]
        result["steps"]["compress"] = run_step("compress", cmd, args.work / "compress.log")
        report = json.loads((out / "qpalette-compress.json").read_text())
        result["steps"]["compress"]["report"] = {k: report[k] for k in ("wall_time_s", "avg_bits", "device", "ranks")}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v.get("wall_s") for k, v in result["steps"].items()}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
