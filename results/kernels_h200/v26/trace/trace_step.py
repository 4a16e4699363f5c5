#!/usr/bin/env python3
"""Diagnostic (QPALETTE_TRACE=1 build of trace.diff): per-CTA %globaltimer records of the GEMV and attention kernels
over a few CUDA-graph decode steps, written as JSON: trace_step.py MODEL --batch B --out FILE."""
import argparse
import json

import torch

from qpalette.measure.bench import DecodeLoop
from qpalette.runtime import kernel_build
from qpalette.runtime.loading import load_model

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--out", required=True)
a = ap.parse_args()
model = load_model(a.model, "cuda", tokenizer=False)[0]
ext = kernel_build.extension()
loop = DecodeLoop(model, a.batch, 64, 8 + a.steps, "reduce-overhead", 0)
for _ in range(8):
    loop.step()
torch.cuda.synchronize()
ext.trace_reset()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
ev[0].record()
for i in range(a.steps):
    loop.step()
    ev[i + 1].record()
torch.cuda.synchronize()
g, at = ext.trace_read(False), ext.trace_read(True)
json.dump({"batch": a.batch, "step_ms": [ev[i].elapsed_time(ev[i + 1]) for i in range(a.steps)],
           "gemv": g.tolist(), "attention": at.tolist()}, open(a.out, "w"))
print(a.batch, [round(ev[i].elapsed_time(ev[i + 1]), 4) for i in range(a.steps)], len(g), len(at))
