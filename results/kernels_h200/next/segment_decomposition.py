# python results/kernels_h200/next/segment_decomposition.py  (CPU, ~1 s; printed max |got - want| = 1.3e-15 against a scale of 4.3)
"""Check: H(s ⊙ x) for n = 4096 equals the H_8 mix of each 512-segment's own H_512(s ⊙ x_seg),
with qpalette's conventions (rotate_input, hadamard_transform, Sylvester order, 1/√n)."""
import torch

from qpalette.quant.hadamard import decompose, hadamard_transform
from qpalette.quant.incoherence import rotate_input

torch.manual_seed(0)
n, seg = 4096, 512
print("decompose(4096) =", decompose(n))
x = torch.randn(8, n, dtype=torch.float64)
s = torch.where(torch.rand(n) < 0.5, -1.0, 1.0).to(torch.float64)
want = rotate_input(x, s)
z = hadamard_transform((s * x).reshape(8, n // seg, seg)) * (seg ** 0.5)  # per-segment unnormalized H_512(s ⊙ x_a)
h8 = hadamard_transform(torch.eye(8, dtype=torch.float64)) * (8 ** 0.5)  # ±1 Sylvester H_8
got = torch.einsum("ja,rab->rjb", h8, z).reshape(8, n) / n ** 0.5
print("max |got - want| =", (got - want).abs().max().item(), " scale", want.abs().max().item())
