#!/usr/bin/env python3
"""One call of the fused kernel per entry on a 14336x4096 layer (batch 1), for ncu to profile:
ncu -k regex:qmm_kernel python3 scripts/kernel_probe.py tcq-2.0 vq-2.0"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qpalette.measure.timing import random_layer  # noqa: E402
from qpalette.runtime import ops

rows, cols = 14336, 4096
for name in sys.argv[1:]:
    t = random_layer(name, rows, cols)
    x = torch.randn(1, cols, device="cuda", dtype=torch.float16)
    for _ in range(2):
        ops.quantized_matmul(x, name, t, (rows, cols))
    torch.cuda.synchronize()
