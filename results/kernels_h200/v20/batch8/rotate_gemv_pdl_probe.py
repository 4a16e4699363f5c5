"""Rotation -> GEMV chains at batch 1, 2, 4, 8 with programmatic dependent launch on and off (results/kernels_h200/v20/ §4).

    python rotate_gemv_pdl_probe.py OUT.json   (a CUDA GPU; qpalette importable)
"""
import json
import os
import sys

import torch

from qpalette.measure.timing import copies_for, stored_bytes, time_graph
from qpalette.quant.incoherence import pack_signs, random_signs
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes, ops

name = "tcq-2.0"
res = {}
for rows, cols in [(4096, 4096), (4096, 14336)]:
    first = lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, None, "cuda"))
    layers = [first] + [lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, None, "cuda")) for _ in range(copies_for(stored_bytes(first)) - 1)]
    signs = pack_signs(random_signs(cols, seed=0)).cuda()
    for m in (1, 2, 4, 8):
        x = torch.randn(m, cols, device="cuda", dtype=torch.float16)
        buf = torch.empty_like(x)
        ways = {
            "plain": [lambda t=t: ops.quantized_matmul(x, name, t, (rows, cols)) for t in layers],
            "copy+gemv": [lambda t=t: ops.quantized_matmul(buf.copy_(x), name, t, (rows, cols)) for t in layers],
            "rotate": [lambda: ops.rotate(x, signs) for t in layers],
            "rotate+gemv": [lambda t=t: ops.quantized_matmul(ops.rotate(x, signs), name, t, (rows, cols)) for t in layers],
            "rotate+copy+gemv": [lambda t=t: ops.quantized_matmul(buf.copy_(ops.rotate(x, signs)), name, t, (rows, cols)) for t in layers],
        }
        for w, calls in ways.items():
            for pdl in ("1", "0"):
                os.environ["QPALETTE_PDL"] = pdl
                us = time_graph(calls) * 1e6
                res[f"{rows}x{cols} m{m} {w} pdl{pdl}"] = us
                print(f"{rows}x{cols} m{m} {w:18s} pdl{pdl} {us:7.2f}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
