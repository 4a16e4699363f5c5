"""The quantizer palette (docs/method.md §2)."""

from qpalette.errors import UnknownQuantizer
from qpalette.quant.palette.base import QuantizedMatrix, Quantizer
from qpalette.quant.palette.registry import FAMILIES, PALETTE, get_quantizer, palette_entries

__all__ = [
    "FAMILIES",
    "PALETTE",
    "QuantizedMatrix",
    "Quantizer",
    "UnknownQuantizer",
    "get_quantizer",
    "palette_entries",
]
