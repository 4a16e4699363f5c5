"""The two operations a quantized layer runs: the online rotation and the quantized matmul.

Both take the stored tensors as they are on disk. On CPU (or when the CUDA kernels are not
available) they run the pure-PyTorch reference: decode to float32, multiply back the row
scales, one matmul. The CUDA kernels (issue 6) plug in here and are tested against these.
"""

from __future__ import annotations

import torch

from .incoherence import rotate_input, unpack_signs
from .palette import QuantizedMatrix, get_quantizer


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """H(s ⊙ x) over the last dimension; `signs` bit-packed uint8 (in/8,). Same dtype as x."""
    return rotate_input(x.float(), unpack_signs(signs)).to(x.dtype)


def dequantize(quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """W_r = decode(codes) ⊙ row_scale (float32, rows × cols) from the stored tensors."""
    q = get_quantizer(quantizer)
    return q.dequantize(QuantizedMatrix(q.name, shape, tensors))


def quantized_matmul(
    x_rot: torch.Tensor, quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]
) -> torch.Tensor:
    """y = x_rot · W_rᵀ for a rotated activation x_rot (..., in); returns (..., out) in x's dtype."""
    w = dequantize(quantizer, tensors, shape)
    return (x_rot.float() @ w.T).to(x_rot.dtype)
