"""Inputs of the planner: sensitivity coefficients, latency profiles (distortion tables live in
qpalette.quant.distortion and are re-exported here).

Formats (all JSON, documented in docs/format.md):
- `qpalette.sensitivity/1` (written by `qpalette calibrate`): per layer a_l, the fit's r², shape.
- `qpalette.latency/1`: per-block latency of each (fusion group, quantizer) kernel call at one batch
  size, plus the constant per-token overhead outside the linear layers.
- `qpalette.distortion/1`: the data-free err(q) table (`DistortionTable`).
- `qpalette.loss_table/1` (written by `qpalette loss-table`): per layer and palette entry the
  measured increase of the calibration loss when that layer alone is quantized (`LossTable`).

Each document is a dataclass with `from_dict(d, path)` (checks `format`, raises InputError naming
the problem), `to_dict()` and one loader, the classmethod `load(path)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from qpalette.errors import InputError, UnknownQuantizer
from qpalette.fileio import read_json_object, sha256_file
from qpalette.models.topology import GROUP_ALIASES, GROUPS
from qpalette.quant.distortion import DISTORTION_FORMAT, DistortionRow, DistortionTable
from qpalette.quant.palette import get_quantizer

SENSITIVITY_FORMAT = "qpalette.sensitivity/1"
LATENCY_FORMAT = "qpalette.latency/1"
LOSS_TABLE_FORMAT = "qpalette.loss_table/1"

__all__ = [
    "DISTORTION_FORMAT", "LATENCY_FORMAT", "LOSS_TABLE_FORMAT", "SENSITIVITY_FORMAT", "DistortionRow",
    "DistortionTable", "LatencyProfile", "LossTable", "Sensitivity", "find_shipped_profile",
    "shipped_latency_profiles",
]


def _finite(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise InputError(f"{what}: {x!r} is not a finite number")
    return float(x)


def _shape(s, what: str) -> tuple[int, int]:
    if not (isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and x > 0 for x in s)):
        raise InputError(f"{what} {s!r} is not [out, in]")
    return (s[0], s[1])


def _check_format(d, fmt: str, where: str, hint: str = "") -> None:
    if not isinstance(d, dict):
        raise InputError(f"{where}: not a JSON object")
    if d.get("format") != fmt:
        raise InputError(
            f"{where}: format is {d.get('format')!r}, expected {fmt!r}" + (f" ({hint})" if hint else "")
        )


# -- sensitivity --------------------------------------------------------------------------------
_SENS_HINT = ("written by `qpalette calibrate`; the paper's table converts with "
              "scripts/import_reference_tables.py")


@dataclass
class Sensitivity:
    """A `qpalette.sensitivity/1` document. `coefficients` are the a_l the planner uses (negative
    fits clamped to 0, see `warnings`); `layers` keeps each layer's row as written."""

    path: str
    sha256: str
    model: str | None
    coefficients: dict[str, float]
    shapes: dict[str, tuple[int, int]]
    meta: dict = field(default_factory=dict)  # every top-level field but `layers`
    warnings: list[str] = field(default_factory=list)
    layers: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        head = {"format": SENSITIVITY_FORMAT} | {k: v for k, v in self.meta.items() if k != "format"}
        layers = self.layers or {
            n: {"a": a, "r2": None, "shape": list(self.shapes[n]) if n in self.shapes else None}
            for n, a in self.coefficients.items()
        }
        return head | {"layers": layers}

    @classmethod
    def from_dict(cls, d: dict, path: str = "sensitivity", sha256: str = "") -> "Sensitivity":
        _check_format(d, SENSITIVITY_FORMAT, path, _SENS_HINT)
        layers = d.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise InputError(f"{path}: 'layers' must be a non-empty object name → {{a, r2, shape}}")
        coeffs, shapes, negative = {}, {}, []
        for name, row in layers.items():
            if not isinstance(row, dict) or "a" not in row:
                raise InputError(f"{path}: layer {name} has no coefficient 'a'")
            a = _finite(row["a"], f"{path}: layer {name} 'a'")
            if a < 0:
                negative.append(name)
            coeffs[name] = max(a, 0.0)
            if row.get("shape") is not None:
                shapes[name] = _shape(row["shape"], f"{path}: layer {name} shape")
        meta = {k: v for k, v in d.items() if k != "layers"}
        return cls(str(path), sha256, d.get("model"), coeffs, shapes, meta,
                   _negative_warning(negative), dict(layers))

    @classmethod
    def load(cls, path: str | Path) -> "Sensitivity":
        data = read_json_object(path, "sensitivity", InputError, SENSITIVITY_FORMAT, _SENS_HINT)
        return cls.from_dict(data, str(path), sha256_file(path))


def _negative_warning(negative: list[str]) -> list[str]:
    if not negative:
        return []
    return [
        f"{len(negative)} layer(s) have a negative fitted coefficient (noise), treated as 0: "
        + ", ".join(negative[:5]) + (" …" if len(negative) > 5 else "")
    ]


# -- loss tables --------------------------------------------------------------------------------
@dataclass
class LossTable:
    """A `qpalette.loss_table/1` document: rows[layer][entry] = measured increase of the calibration
    loss with that layer alone quantized by that entry (docs/method.md §8); entry names canonical."""

    path: str
    sha256: str
    model: str | None
    rows: dict[str, dict[str, float]]
    shapes: dict[str, tuple[int, int]]
    meta: dict = field(default_factory=dict)  # every top-level field but `rows` and `shapes`

    def implied_coefficient(self, layer: str, err: dict[str, float]) -> float:
        """a_l of the linear model Δloss ≈ a_l·err(q) fitted to the layer's row (least squares
        through the origin, clamped at 0): what the plan reports as `a` and the bound uses."""
        pairs = [(err[q], d) for q, d in self.rows[layer].items() if q in err]
        sxx = sum(e * e for e, _ in pairs)
        return max(0.0, sum(e * d for e, d in pairs) / sxx) if sxx > 0 else 0.0

    @classmethod
    def from_dict(cls, d: dict, path: str = "loss table", sha256: str = "") -> "LossTable":
        _check_format(d, LOSS_TABLE_FORMAT, path, "written by `qpalette loss-table`")
        raw = d.get("rows")
        if not isinstance(raw, dict) or not raw:
            raise InputError(f"{path}: 'rows' must be a non-empty object layer → {{entry: delta_loss}}")
        rows = {}
        for layer, row in raw.items():
            if not isinstance(row, dict):
                raise InputError(f"{path}: row {layer} must map palette entry → delta_loss")
            rows[layer] = {_quantizer_name(q, f"{path}: row {layer}"): _finite(v, f"{path}: {layer} {q}")
                           for q, v in row.items()}
        shapes = {n: _shape(s, f"{path}: shape of {n}") for n, s in (d.get("shapes") or {}).items()}
        meta = {k: v for k, v in d.items() if k not in ("rows", "shapes")}
        return cls(str(path), sha256, d.get("model"), rows, shapes, meta)

    @classmethod
    def load(cls, path: str | Path) -> "LossTable":
        data = read_json_object(path, "loss table", InputError, LOSS_TABLE_FORMAT,
                                "written by `qpalette loss-table`")
        return cls.from_dict(data, str(path), sha256_file(path))


# -- latency profiles ---------------------------------------------------------------------------
_LAT_TYPED = ("format", "model", "device", "batch_size", "constant_s", "shapes", "groups")
_LAT_HINT = "the paper's RTX 4090 table converts with scripts/import_reference_tables.py"


@dataclass
class LatencyProfile:
    """A `qpalette.latency/1` document (group names and quantizer names canonical)."""

    path: str
    sha256: str
    model: str | None
    device: str | None
    batch_size: int
    constant_s: float
    groups: dict[str, dict[str, float]]  # group → quantizer name → seconds per block per step
    shapes: dict[str, tuple[int, int]]  # group → [out, in] of the (row-concatenated) matrix
    meta: dict = field(default_factory=dict)  # every top-level field but `groups` and `shapes`

    def quantizers(self) -> set[str]:
        return {q for g in self.groups.values() for q in g}

    def times_lm_head(self) -> bool:
        """Whether a quantized lm_head can be priced: its group and its 16-bit time are measured."""
        return bool(self.groups.get("head")) and "lm_head_s" in (self.meta.get("constant") or {})

    @property
    def fused_block_saving_s(self) -> float:
        """What a decoder block's step saves when its residual adds and norms run inside its kernels
        (`runtime.modules.install_fused_block`: the GEMVs at batch 1, the rotation kernels at batch
        2–8, for blocks whose q/k/v and gate/up are fused groups: `program.fused_blocks`).
        `constant_s` holds the unfused blocks' work; 0 in profiles from before it was measured."""
        return float(self.meta.get("fused_block_saving_s", 0.0))

    def with_quantized_head(self) -> "LatencyProfile":
        """This profile for a plan that quantizes lm_head (the head's kernel is then one of the
        plan's calls): the constant measured with a quantized head, or, in profiles from before it
        was measured, constant_s without the 16-bit head's time and with the head's own rotation."""
        parts = self.meta["constant"]
        const = parts.get("constant_quantized_head_s",
                          self.constant_s - parts["lm_head_s"] + parts.get("lm_head_rotation_s", 0.0))
        return replace(self, constant_s=max(const, 0.0))

    def to_dict(self) -> dict:
        """The document in `qpalette profile`'s key order (typed fields first, then the rest)."""
        return {
            "format": LATENCY_FORMAT, "model": self.model, "device": self.device,
            "batch_size": self.batch_size, "constant_s": self.constant_s,
            "shapes": {g: list(s) for g, s in self.shapes.items()},
            "groups": {g: dict(row) for g, row in self.groups.items()},
        } | {k: v for k, v in self.meta.items() if k not in _LAT_TYPED}

    @classmethod
    def from_dict(cls, d: dict, path: str = "latency profile", sha256: str = "") -> "LatencyProfile":
        _check_format(d, LATENCY_FORMAT, path, _LAT_HINT)
        bs = d.get("batch_size")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise InputError(f"{path}: batch_size {bs!r} is not a positive integer")
        const = _finite(d.get("constant_s"), f"{path}: constant_s")
        if "fused_block_saving_s" in d and _finite(d["fused_block_saving_s"], f"{path}: fused_block_saving_s") < 0:
            raise InputError(f"{path}: fused_block_saving_s is negative")
        groups = _latency_groups(d.get("groups"), path)
        shapes = {GROUP_ALIASES.get(g, g): _shape(s, f"{path}: shape of group {g}")
                  for g, s in (d.get("shapes") or {}).items()}
        meta = {k: v for k, v in d.items() if k not in ("groups", "shapes")}
        return cls(str(path), sha256, d.get("model"), d.get("device"), bs, const, groups, shapes, meta)

    @classmethod
    def load(cls, path: str | Path) -> "LatencyProfile":
        data = read_json_object(path, "latency profile", InputError, LATENCY_FORMAT, _LAT_HINT)
        return cls.from_dict(data, str(path), sha256_file(path))


def _latency_groups(raw, path: str) -> dict[str, dict[str, float]]:
    """group → canonical quantizer name → seconds; every group known, every time finite ≥ 0."""
    if not isinstance(raw, dict) or not raw:
        raise InputError(f"{path}: 'groups' must map group → quantizer → seconds")
    groups: dict[str, dict[str, float]] = {}
    for g, row in raw.items():
        gname = GROUP_ALIASES.get(g, g)
        if gname not in GROUPS:
            raise InputError(f"{path}: unknown group {g!r}; groups are {', '.join(GROUPS)}")
        if not isinstance(row, dict):
            raise InputError(f"{path}: group {g} must map quantizer → seconds")
        groups[gname] = {_quantizer_name(q, f"{path}: group {g}"): _latency(t, f"{path}: group {g} quantizer {q}")
                         for q, t in row.items()}
    return groups


def _quantizer_name(name: str, where: str) -> str:
    try:
        return get_quantizer(name).name
    except UnknownQuantizer:
        raise InputError(f"{where}: unknown quantizer {name!r}") from None


def _latency(t, what: str) -> float:
    t = _finite(t, what)
    if t < 0:
        raise InputError(f"{what}: negative latency {t}")
    return t


def shipped_latency_profiles() -> list[Path]:
    """The measured profiles shipped in profiles/ (`<gpu>_latency_<model>_b<batch>.json`)."""
    from qpalette.quant.codebooks import profiles_dir

    return sorted(profiles_dir().glob("*_latency_*_b*.json"))


def find_shipped_profile(layers, batch_size: int | None, check, gpu: str | None = None) -> LatencyProfile | None:
    """A shipped profile whose group shapes fit the model (`check` raises InputError when they do
    not) at the batch size asked for (default 1): the one measured on `gpu` (a device name as
    torch reports it) if there is one, else the first; None if none fits."""
    fitting = []
    for path in shipped_latency_profiles():
        prof = LatencyProfile.load(path)
        if prof.batch_size != (batch_size or 1) or not prof.shapes:
            continue
        try:
            check(prof, layers)
        except InputError:
            continue
        fitting.append(prof)
    same_gpu = [prof for prof in fitting if gpu is not None and prof.device == gpu]
    return (same_gpu or fitting or [None])[0]
