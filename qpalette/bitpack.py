"""MSB-first bit streams packed into int32 words.

Stream bit i lives in word i // 32 at bit 31 − (i mod 32). Every packed tile of every palette
entry is 256·bits bits = 8·bits words, so tiles never share a word.
"""

from __future__ import annotations

import torch


def to_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n) non-negative ints → (..., n·width) bits, MSB first, uint8."""
    shifts = torch.arange(width - 1, -1, -1, device=values.device)
    bits = (values.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*values.shape[:-1], -1).to(torch.uint8)


def from_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n·width) bits → (..., n) int64 values."""
    b = bits.to(torch.int64).reshape(*bits.shape[:-1], -1, width)
    weights = torch.ones(width, dtype=torch.int64, device=bits.device) << torch.arange(
        width - 1, -1, -1, device=bits.device
    )
    return (b * weights).sum(-1)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 32·w) bits → (..., w) int32 words."""
    if bits.shape[-1] % 32:
        raise ValueError(f"bit stream of {bits.shape[-1]} bits is not a whole number of words")
    words = from_bits(bits, 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """(..., w) int32 words → (..., 32·w) bits."""
    return to_bits(words.to(torch.int64) & 0xFFFFFFFF, 32)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n) codes of `width` bits → (..., n·width/32) int32 words."""
    return pack_bits(to_bits(codes, width))


def unpack_codes(words: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of `pack_codes`."""
    return from_bits(unpack_bits(words), width)
