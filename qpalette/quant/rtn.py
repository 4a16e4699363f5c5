"""Reference points that are not qpalette quantizers: plain round-to-nearest (RTN) with groups.

RTN-b g-G: each row is cut into groups of G input columns (the last group shorter when G does
not divide the row, e.g. 576 = 4·128 + 64 in SmolLM2); each group is mapped to 2^b uniform levels
between its min and max (asymmetric, fp16 scale and zero point), no rotation. Stored cost: b bits
per weight plus 32 bits per group (4.25 for 4-bit g128 on rows that 128 divides). Used as fake
quantization (the weights are replaced by their RTN reconstruction), which is all a perplexity
comparison needs.
"""

from __future__ import annotations

import math

import torch


def rtn_fake_quantize(w: torch.Tensor, bits: int = 4, group: int = 128) -> torch.Tensor:
    """W → its RTN reconstruction (same shape and dtype)."""
    parts = []
    for g in w.float().split(group, dim=1):
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        scale = ((hi - lo) / (2**bits - 1)).half().float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = lo.half().float()
        parts.append(torch.clamp(torch.round((g - zero) / scale), 0, 2**bits - 1) * scale + zero)
    return torch.cat(parts, dim=1).to(w.dtype)


def rtn_bits(bits: int, group: int, cols: int) -> float:
    """Average stored bits per weight of a row of `cols`: codes + fp16 scale and zero per group."""
    return bits + 32 * math.ceil(cols / group) / cols
