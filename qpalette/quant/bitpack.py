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


def read_fields(words: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """(..., w) int32 words → (..., n) int64: the `width`-bit field (≤ 32) starting at each bit
    offset, MSB first, reading circularly (a field past the last word continues in word 0).

    Works on two words at a time instead of one byte per bit: the reference decode's fast path."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    first = offsets // 32
    hi = u[..., first]
    lo = u[..., (first + 1) % words.shape[-1]]
    window = (hi << 32) | lo  # stream bits 32·first … 32·first + 63, bit 63 first
    return (window >> (64 - offsets % 32 - width)) & ((1 << width) - 1)


def unpack_codes(words: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of `pack_codes`."""
    n = words.shape[-1] * 32 // width
    return read_fields(words, torch.arange(n, device=words.device) * width, width)
