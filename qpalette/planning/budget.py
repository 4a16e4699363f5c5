"""Budget strings of `qpalette plan --budget`.

Memory:  `3.25bits` (also `3.25bit`, `3.25bpw`): average nominal bits per quantized linear weight,
         weighted by parameter count (codebooks, scales, sign vectors and unquantized modules not
         counted), as in the paper.
         `2.4GB`, `900MB`, `7.5GiB`, `123456789B` ...: every byte of the checkpoint (codes, fp16
         row scales, sign vectors, codebooks and the unquantized modules). KB/MB/GB/TB are powers
         of 1000, KiB/MiB/GiB/TiB powers of 1024.
Speed:   `200tok/s` (also `200tps`): decode steps per second at the profile's batch size;
         `5ms`, `5000us`, `0.005s`: latency per decode step.
Several budgets combine (all must hold): repeat --budget or give a comma list
(`3.25bits,200tok/s`). At most one budget of each kind (bits, bytes, latency).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from qpalette.errors import BudgetError

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}


@dataclass(frozen=True)
class Budget:
    kind: str  # "bits" | "bytes" | "latency"
    value: float  # bits per weight | bytes | seconds per decode step
    text: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "text": self.text}

    @classmethod
    def from_dict(cls, d: dict, where: str = "budget") -> "Budget":
        """A budget as stored in a plan file ({kind, value, text})."""
        if not isinstance(d, dict) or d.get("kind") not in ("bits", "bytes", "latency"):
            raise BudgetError(f"{where}: {d!r} is not a budget {{kind: bits|bytes|latency, value, text}}")
        value, text = d.get("value"), d.get("text")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(text, str):
            raise BudgetError(f"{where}: {d!r} needs a numeric value and a text")
        return cls(d["kind"], value, text)

    @property
    def bits_fraction(self) -> Fraction:
        return Fraction(self.text_number())

    def text_number(self) -> str:
        m = re.match(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)", self.text, re.I)
        return m[1] if m else repr(self.value)


def parse_one(text: str) -> Budget:
    s = text.strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]+)", s)
    if not m:
        raise BudgetError(
            f"budget {text!r} not understood; examples: 3.25bits, 2.4GB, 900MiB, 200tok/s, 5ms"
        )
    num, unit = float(m[1]), m[2].lower()
    if num <= 0:
        raise BudgetError(f"budget {text!r} must be positive")
    if unit in ("bits", "bit", "bpw"):
        return Budget("bits", num, s)
    if unit in _UNITS:
        return Budget("bytes", float(int(num * _UNITS[unit])), s)
    if unit in ("tok/s", "tokens/s", "tps", "token/s"):
        return Budget("latency", 1.0 / num, s)
    if unit in _TIME:
        return Budget("latency", num * _TIME[unit], s)
    raise BudgetError(
        f"budget {text!r}: unknown unit {m[2]!r}; use bits, B/KB/MB/GB/TB, KiB/MiB/GiB/TiB, "
        "tok/s, s/ms/us"
    )


def parse_budgets(texts: list[str]) -> list[Budget]:
    out: list[Budget] = []
    for t in texts:
        for part in t.split(","):
            if part.strip():
                out.append(parse_one(part))
    if not out:
        raise BudgetError("no budget given; e.g. --budget 3.25bits or --budget 200tok/s")
    kinds = [b.kind for b in out]
    for k in set(kinds):
        if kinds.count(k) > 1:
            raise BudgetError(
                f"{kinds.count(k)} {k} budgets given ({', '.join(b.text for b in out if b.kind == k)}); "
                "give at most one of each kind"
            )
    return out
