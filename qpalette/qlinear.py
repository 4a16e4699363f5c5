"""A quantized linear layer in pure PyTorch: the reference the CUDA kernels are checked against.

y = (decode(codes) ⊙ row_scale) · H(s ⊙ x) + b, i.e. the rotated weight W_r = W · diag(s) · Hᵀ
applied to the rotated activation. Buffers carry exactly the names, shapes and dtypes that
`Quantizer.tensor_specs` gives (plus `signs`, bit-packed), so a module built empty can load a
checkpoint's tensors as they are. Deliberately not an `nn.Linear` subclass: transformers
re-initialises those.
"""

from __future__ import annotations

import torch
from torch import nn

from .incoherence import pack_signs, random_signs, rotate_input, rotate_weight, unpack_signs
from .palette import QuantizedMatrix, get_quantizer


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, quantizer: str, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizer = get_quantizer(quantizer)
        for name, (shape, dtype) in self.quantizer.tensor_specs(out_features, in_features).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))
        self.register_buffer("signs", torch.zeros(in_features // 8, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def extra_repr(self) -> str:
        return f"{self.in_features}→{self.out_features}, {self.quantizer.name}"

    @classmethod
    def from_float(cls, linear: nn.Linear, quantizer: str, seed: int, device=None) -> "QuantizedLinear":
        """Rotate and quantize a float layer (quantization runs on `device`, default its own)."""
        out_f, in_f = linear.weight.shape
        mod = cls(in_f, out_f, quantizer, bias=linear.bias is not None)
        signs = random_signs(in_f, seed)
        w = linear.weight.detach().to(device or linear.weight.device, torch.float32)
        qm = mod.quantizer.quantize(rotate_weight(w, signs))
        for name, t in qm.tensors.items():
            getattr(mod, name).copy_(t)
        mod.signs.copy_(pack_signs(signs))
        if linear.bias is not None:
            mod.bias.data.copy_(linear.bias.detach())
        return mod

    def rotated_weight(self) -> torch.Tensor:
        """decode(codes) ⊙ row_scale in float32: W_r, the weight in the rotated domain."""
        shape = (self.out_features, self.in_features)
        tensors = {n: getattr(self, n) for n in self.quantizer.tensor_specs(*shape)}
        return self.quantizer.dequantize(QuantizedMatrix(self.quantizer.name, shape, tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xr = rotate_input(x.float(), unpack_signs(self.signs))
        y = xr @ self.rotated_weight().T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)
