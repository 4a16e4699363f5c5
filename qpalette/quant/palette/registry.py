"""The palette: every quantizer kind by name (`tcq-3.0`, `half-tcq-3.25`, `vq-2.5`, `nuq-4`)."""

from __future__ import annotations

import re

from qpalette.errors import UnknownQuantizer
from qpalette.quant.palette.base import Quantizer, format_bits
from qpalette.quant.palette.nuq import NUQ
from qpalette.quant.palette.tcq import TCQ, HalfTCQ
from qpalette.quant.palette.vq import VQ


def _halves(lo: float, hi: float) -> list[float]:
    return [lo + 0.5 * i for i in range(int(round((hi - lo) / 0.5)) + 1)]


def _build() -> dict[str, Quantizer]:
    entries: list[Quantizer] = [NUQ(b) for b in range(2, 9)]
    entries += [VQ(b) for b in _halves(1.5, 6.0)]
    entries += [TCQ(b) for b in _halves(1.0, 5.0)]
    entries += [HalfTCQ(b + 0.25) for b in _halves(1.0, 4.5)]
    return {q.name: q for q in entries}


PALETTE: dict[str, Quantizer] = _build()
FAMILIES = ("nuq", "vq", "tcq", "half-tcq")


def get_quantizer(name: str) -> Quantizer:
    """Look up a palette entry; accepts `tcq-3`, `TCQ-3.0`, `half-tcq-3.25`, `nuq-4.0`."""
    m = re.fullmatch(r"\s*(half-tcq|tcq|vq|nuq)-(\d+(?:\.\d+)?)\s*", name.lower())
    if m:
        key = f"{m[1]}-{format_bits(m[1], float(m[2]))}"
        if key in PALETTE and abs(PALETTE[key].bits - float(m[2])) < 1e-9:
            return PALETTE[key]
    raise UnknownQuantizer(
        f"unknown quantizer {name!r}; the palette has {len(PALETTE)} entries: "
        + ", ".join(PALETTE)
    )


def palette_entries(families: tuple[str, ...] | None = None) -> list[Quantizer]:
    return [q for q in PALETTE.values() if families is None or q.family in families]
