"""Inputs of the planner: sensitivity coefficients, latency profiles, distortion tables.

Formats (all JSON, documented in docs/format.md):
- `qpalette.sensitivity/1` (written by `qpalette calibrate`): per layer a_l, the fit's r², shape.
- `qpalette.latency/1`: per-block latency of each (fusion group, quantizer) kernel call at one batch
  size, plus the constant per-token overhead outside the linear layers.
- `qpalette.distortion/1`: the data-free err(q) table (qpalette.distortion).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from qpalette.errors import InputError, UnknownQuantizer
from qpalette.fileio import read_json_object
from qpalette.models.topology import GROUP_ALIASES, GROUPS
from qpalette.quant.distortion import DistortionRow
from qpalette.quant.palette import get_quantizer

SENSITIVITY_FORMAT = "qpalette.sensitivity/1"
LATENCY_FORMAT = "qpalette.latency/1"
DISTORTION_FORMAT = "qpalette.distortion/1"



def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _finite(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise InputError(f"{what}: {x!r} is not a finite number")
    return float(x)


# -- sensitivity --------------------------------------------------------------------------------
@dataclass
class Sensitivity:
    path: str
    sha256: str
    model: str | None
    coefficients: dict[str, float]
    shapes: dict[str, tuple[int, int]]
    meta: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def load_sensitivity(path: str | Path) -> Sensitivity:
    data = read_json_object(
        path, "sensitivity", InputError, SENSITIVITY_FORMAT,
        "written by `qpalette calibrate`; the paper's table converts with "
        "scripts/import_reference_tables.py",
    )
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise InputError(f"{path}: 'layers' must be a non-empty object name → {{a, r2, shape}}")
    coeffs, shapes, warnings, negative = {}, {}, [], []
    for name, row in layers.items():
        if not isinstance(row, dict) or "a" not in row:
            raise InputError(f"{path}: layer {name} has no coefficient 'a'")
        a = _finite(row["a"], f"{path}: layer {name} 'a'")
        if a < 0:
            negative.append(name)
            a = 0.0
        coeffs[name] = a
        if row.get("shape") is not None:
            s = row["shape"]
            if not (isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and x > 0 for x in s)):
                raise InputError(f"{path}: layer {name} shape {s!r} is not [out, in]")
            shapes[name] = (s[0], s[1])
    if negative:
        warnings.append(
            f"{len(negative)} layer(s) have a negative fitted coefficient (noise), treated as 0: "
            + ", ".join(negative[:5]) + (" …" if len(negative) > 5 else "")
        )
    meta = {k: v for k, v in data.items() if k not in ("layers",)}
    return Sensitivity(str(path), sha256_file(path), data.get("model"), coeffs, shapes, meta, warnings)


# -- latency profiles ---------------------------------------------------------------------------
@dataclass
class LatencyProfile:
    path: str
    sha256: str
    model: str | None
    device: str | None
    batch_size: int
    constant_s: float
    groups: dict[str, dict[str, float]]  # group → quantizer name → seconds per block per step
    shapes: dict[str, tuple[int, int]]  # group → [out, in] of the (row-concatenated) matrix
    meta: dict = field(default_factory=dict)

    def quantizers(self) -> set[str]:
        return {q for g in self.groups.values() for q in g}


def load_latency(path: str | Path) -> LatencyProfile:
    data = read_json_object(
        path, "latency profile", InputError, LATENCY_FORMAT,
        "the paper's RTX 4090 table converts with scripts/import_reference_tables.py",
    )
    bs = data.get("batch_size")
    if not isinstance(bs, int) or bs < 1:
        raise InputError(f"{path}: batch_size {bs!r} is not a positive integer")
    const = _finite(data.get("constant_s"), f"{path}: constant_s")
    raw = data.get("groups")
    if not isinstance(raw, dict) or not raw:
        raise InputError(f"{path}: 'groups' must map group → quantizer → seconds")
    groups: dict[str, dict[str, float]] = {}
    for g, row in raw.items():
        gname = GROUP_ALIASES.get(g, g)
        if gname not in GROUPS:
            raise InputError(f"{path}: unknown group {g!r}; groups are {', '.join(GROUPS)}")
        if not isinstance(row, dict):
            raise InputError(f"{path}: group {g} must map quantizer → seconds")
        out = {}
        for qname, t in row.items():
            try:
                q = get_quantizer(qname).name
            except UnknownQuantizer:
                raise InputError(f"{path}: group {g}: unknown quantizer {qname!r}") from None
            t = _finite(t, f"{path}: group {g} quantizer {qname}")
            if t < 0:
                raise InputError(f"{path}: group {g} quantizer {qname}: negative latency {t}")
            out[q] = t
        groups[gname] = out
    shapes = {}
    for g, s in (data.get("shapes") or {}).items():
        gname = GROUP_ALIASES.get(g, g)
        if not (isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and x > 0 for x in s)):
            raise InputError(f"{path}: shape of group {g} {s!r} is not [out, in]")
        shapes[gname] = (s[0], s[1])
    meta = {k: v for k, v in data.items() if k not in ("groups", "shapes")}
    return LatencyProfile(
        str(path), sha256_file(path), data.get("model"), data.get("device"), bs, const, groups,
        shapes, meta,
    )


# -- distortion ---------------------------------------------------------------------------------
@dataclass
class DistortionTable:
    path: str
    sha256: str
    rows: dict[str, DistortionRow]


def load_distortion(path: str | Path | None = None) -> DistortionTable:
    """A distortion table (default: the shipped measured one)."""
    from qpalette.quant.codebooks import profiles_dir
    from qpalette.quant.distortion import TABLE_FILE

    p = Path(path) if path else profiles_dir() / TABLE_FILE
    data = read_json_object(p, "distortion table", InputError, DISTORTION_FORMAT)
    rows = {}
    for r in data.get("rows", []):
        try:
            name = get_quantizer(r["name"]).name
            nmse = _finite(r["nmse"], f"{p}: {r['name']} nmse")
        except (KeyError, TypeError):
            raise InputError(f"{p}: row {r!r} lacks name/nmse") from None
        except UnknownQuantizer:
            raise InputError(f"{p}: unknown quantizer {r.get('name')!r}") from None
        rows[name] = DistortionRow(
            name, r.get("family"), float(r.get("bits")), nmse, float(r.get("rd_bound", 0.0)),
            float(r.get("gap_db") or 0.0), r.get("stderr"),
        )
    if not rows:
        raise InputError(f"{p}: no rows")
    return DistortionTable(str(p), sha256_file(p), rows)


def shipped_latency_profiles() -> list[Path]:
    """The measured profiles shipped in profiles/ (`<gpu>_latency_<model>_b<batch>.json`)."""
    from qpalette.quant.codebooks import profiles_dir

    return sorted(profiles_dir().glob("*_latency_*_b*.json"))


def find_shipped_profile(layers, batch_size: int | None, check) -> LatencyProfile | None:
    """The first shipped profile whose group shapes fit the model (`check` raises InputError
    when they do not) at the batch size asked for (default 1); None if there is none."""
    for path in shipped_latency_profiles():
        prof = load_latency(path)
        if prof.batch_size != (batch_size or 1) or not prof.shapes:
            continue
        try:
            check(prof, layers)
        except InputError:
            continue
        return prof
    return None
