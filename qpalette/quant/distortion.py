"""Data-free distortion table (docs/method.md §3): normalised MSE of each palette entry on N(0,1) data."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qpalette.fileio import atomic_write_json
from qpalette.quant.codebooks import profiles_dir
from qpalette.quant.palette import Quantizer

TABLE_FILE = "distortion_gaussian.json"


@dataclass
class DistortionRow:
    name: str
    family: str
    bits: float
    nmse: float
    rd_bound: float
    gap_db: float
    stderr: float  # standard error of nmse across 16-row blocks of the test matrix

    @classmethod
    def of(cls, q: Quantizer, nmse: float, stderr: float) -> "DistortionRow":
        bound = 2.0 ** (-2 * q.bits)
        return cls(q.name, q.family, q.bits, nmse, bound, 10 * math.log10(nmse / bound), stderr)


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


def shipped_table(path: Path | None = None) -> dict[str, DistortionRow]:
    """The measured table shipped in profiles/ (name → row)."""
    path = path or profiles_dir() / TABLE_FILE
    data = json.loads(Path(path).read_text())
    return {r["name"]: DistortionRow(**r) for r in data["rows"]}


def write_table(rows: list[DistortionRow], path: Path, how: dict) -> None:
    atomic_write_json(
        path, {"format": "qpalette.distortion/1", "measured": how, "rows": [asdict(r) for r in rows]}
    )


def measure_all(
    entries: list[Quantizer], rows: int, cols: int, seed: int, device: str, progress=None
) -> tuple[list[DistortionRow], dict]:
    out = []
    t0 = time.time()
    for q in entries:
        out.append(measure(q, rows, cols, seed, device))
        if progress:
            progress(out[-1])
    how = {"rows": rows, "cols": cols, "seed": seed, "device": device, "seconds": time.time() - t0}
    return out, how
