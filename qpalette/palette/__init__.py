"""The quantizer palette (SPEC §2)."""

from .base import QuantizedMatrix, Quantizer
from .registry import FAMILIES, PALETTE, UnknownQuantizer, get_quantizer, palette_entries

__all__ = [
    "FAMILIES",
    "PALETTE",
    "QuantizedMatrix",
    "Quantizer",
    "UnknownQuantizer",
    "get_quantizer",
    "palette_entries",
]
