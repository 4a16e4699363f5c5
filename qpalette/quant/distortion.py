"""Data-free distortion table (docs/method.md §3): normalised MSE of each palette entry on N(0,1) data.

`DistortionTable` is the one reader and writer of `qpalette.distortion/1` files (the shipped
profiles/distortion_gaussian.json by default); `measure_table` measures a new one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qpalette.errors import InputError, UnknownQuantizer
from qpalette.fileio import atomic_write_json, read_json_object, sha256_file
from qpalette.quant.codebooks import profiles_dir
from qpalette.quant.palette import Quantizer, get_quantizer

TABLE_FILE = "distortion_gaussian.json"
DISTORTION_FORMAT = "qpalette.distortion/1"


@dataclass
class DistortionRow:
    name: str
    family: str
    bits: float
    nmse: float
    rd_bound: float
    gap_db: float
    stderr: float | None  # standard error of nmse across 16-row blocks of the test matrix

    @classmethod
    def of(cls, q: Quantizer, nmse: float, stderr: float) -> "DistortionRow":
        bound = 2.0 ** (-2 * q.bits)
        return cls(q.name, q.family, q.bits, nmse, bound, 10 * math.log10(nmse / bound), stderr)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, r: dict, where: str = "distortion table") -> "DistortionRow":
        """A row as read from a file: the name is canonicalised (`tcq-3` → `tcq-3.0`), nmse must
        be a finite number; rd_bound and gap_db default to 0 where a table lacks them."""
        try:
            name = get_quantizer(r["name"]).name
            nmse = r["nmse"]
        except UnknownQuantizer:  # a KeyError: caught first
            raise InputError(f"{where}: unknown quantizer {r.get('name')!r}") from None
        except (KeyError, TypeError):
            raise InputError(f"{where}: row {r!r} lacks name/nmse") from None
        if isinstance(nmse, bool) or not isinstance(nmse, (int, float)) or not math.isfinite(nmse):
            raise InputError(f"{where}: {r['name']} nmse: {nmse!r} is not a finite number")
        return cls(
            name, r.get("family"), float(r.get("bits")), float(nmse), float(r.get("rd_bound") or 0.0),
            float(r.get("gap_db") or 0.0), r.get("stderr"),
        )


@dataclass
class DistortionTable:
    """A `qpalette.distortion/1` document: err(q) per palette entry (name → row, file order)."""

    rows: dict[str, DistortionRow]
    measured: dict = field(default_factory=dict)  # how (matrix size, seed, device, source)
    path: str | None = None  # where it was read from; None if built in memory
    sha256: str | None = None  # of the file read

    def to_dict(self) -> dict:
        return {"format": DISTORTION_FORMAT, "measured": self.measured,
                "rows": [r.to_dict() for r in self.rows.values()]}

    @classmethod
    def from_dict(cls, d: dict, path: str | None = None, sha256: str | None = None) -> "DistortionTable":
        where = path or "distortion table"
        if not isinstance(d, dict) or d.get("format") != DISTORTION_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise InputError(f"{where}: format is {got!r}, expected {DISTORTION_FORMAT!r}")
        raw = d.get("rows")
        if not isinstance(raw, list):
            raise InputError(f"{where}: 'rows' must be a list of {{name, nmse, ...}}")
        rows = {}
        for r in raw:
            row = DistortionRow.from_dict(r, where)
            rows[row.name] = row
        if not rows:
            raise InputError(f"{where}: no rows")
        return cls(rows, d.get("measured") or {}, path, sha256)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "DistortionTable":
        """A distortion table file (default: the shipped measured one in profiles/)."""
        p = Path(path) if path else profiles_dir() / TABLE_FILE
        data = read_json_object(p, "distortion table", InputError, DISTORTION_FORMAT)
        return cls.from_dict(data, str(p), sha256_file(p))

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())


def measure(q: Quantizer, rows: int, cols: int, seed: int = 0, device: str = "cpu") -> DistortionRow:
    """‖Q(W) − W‖² / ‖W‖² on a rows×cols i.i.d. N(0,1) matrix (same matrix for every entry)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).to(device)
    err = (q.dequantize(q.quantize(w)) - w).pow(2)
    block_err = err.reshape(rows // 16, -1).sum(-1)
    block_norm = w.pow(2).reshape(rows // 16, -1).sum(-1)
    nmse = float(err.sum() / w.pow(2).sum())
    ratios = block_err / block_norm
    stderr = float(ratios.std() / math.sqrt(ratios.numel())) if ratios.numel() > 1 else float("nan")
    return DistortionRow.of(q, nmse, stderr)


def measure_table(entries: list[Quantizer], rows: int, cols: int, seed: int, device: str,
                  progress=None) -> DistortionTable:
    """Every entry measured on one rows×cols Gaussian matrix; `progress(row)` after each."""
    out = {}
    t0 = time.time()
    for q in entries:
        out[q.name] = measure(q, rows, cols, seed, device)
        if progress:
            progress(out[q.name])
    how = {"rows": rows, "cols": cols, "seed": seed, "device": device, "seconds": time.time() - t0}
    return DistortionTable(out, how)
