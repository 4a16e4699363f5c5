"""Versioned recipes of the pipeline's steps: what a calibration, a plan or a compression does,
apart from where it reads and writes and how it reports progress.

Each config is a dataclass with a class-level `VERSION`. `to_dict()` is the JSON object the
step records under the key "config" of what it writes (the sensitivity file, the plan, the
compress report `qpalette-compress.json`); `from_dict` and `load` read it back, so a run can be
repeated from its output:

    cfg = qpalette.PlanConfig.load("plan.json")
    qpalette.plan("smollm2-135m", config=cfg, sensitivity="sens.json")

A document written by a newer qpalette (a higher version) or with fields this one does not know
is refused with a message; missing fields take their defaults.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

from qpalette.errors import InputError

C = TypeVar("C", bound="Config")


@dataclass(kw_only=True)
class Config:
    """The versioned, JSON-serialisable base of the step configs."""

    VERSION: ClassVar[int] = 1

    def __post_init__(self) -> None:
        """Every recipe field checked against its type (lists stored as lists)."""
        recipe = next(k for k in type(self).__mro__ if Config in k.__bases__)
        hints = typing.get_type_hints(recipe)
        for f in dataclasses.fields(recipe):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise InputError(f"{recipe.__name__}.{f.name} = {value!r} is not {_type_text(hints[f.name])}")
            if isinstance(value, tuple):
                setattr(self, f.name, list(value))

    def to_dict(self) -> dict:
        """{"type": class name, "version": VERSION, every field}: what the step writes as "config"."""
        return {"type": type(self).__name__, "version": self.VERSION,
                **{k: list(v) if isinstance(v, list) else v for k, v in self.values().items()}}

    @classmethod
    def of(cls: type[C], obj) -> C:
        """This config's fields taken from `obj` (for instance a step's options, which extend it)."""
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})

    def values(self) -> dict:
        """The fields as keyword arguments (for a step's options)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def updated(self: C, **changes) -> C:
        """A copy with `changes` (field names of this config) applied."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise InputError(f"{type(self).__name__} has no option {', '.join(unknown)} "
                             f"(its options: {', '.join(f.name for f in dataclasses.fields(self))})")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls: type[C], d, where: str | None = None) -> C:
        """The config of `d` (as `to_dict` writes it); a clear InputError for anything else."""
        where = where or cls.__name__
        if not isinstance(d, dict):
            raise InputError(f"{where}: a {cls.__name__} is a JSON object, not {type(d).__name__}")
        if d.get("type") != cls.__name__:
            raise InputError(f"{where}: 'type' is {d.get('type')!r}, expected {cls.__name__!r}")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise InputError(f"{where}: 'version' must be a positive integer, not {version!r}")
        if version > cls.VERSION:
            raise InputError(f"{where}: written by a newer qpalette ({cls.__name__} version {version}; this "
                             f"one reads up to {cls.VERSION}): upgrade qpalette")
        values = {k: v for k, v in d.items() if k not in ("type", "version")}
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"{where}: unknown field(s) {', '.join(unknown)} for {cls.__name__}")
        try:
            return cls(**values)
        except InputError as e:
            raise InputError(f"{where}: {e}" if where != cls.__name__ else str(e)) from None

    @classmethod
    def load(cls: type[C], path: str | Path) -> C:
        """The config of a JSON file: a step's output that records one under "config" (a
        sensitivity file, a plan, a compress report or the compressed folder holding it), or a
        config written on its own."""
        from qpalette.fileio import read_json_object

        p = Path(path)
        if p.is_dir():
            p = p / "qpalette-compress.json"
        doc = read_json_object(p, cls.__name__, InputError)
        if "config" in doc:
            return cls.from_dict(doc["config"], f"{p}: config")
        if "type" not in doc:
            raise InputError(f"{p} records no config (written before configs were recorded, or not a "
                             "qpalette file)")
        return cls.from_dict(doc, str(p))


@dataclass(kw_only=True)
class CalibrateConfig(Config):
    """`qpalette calibrate`: per-layer sensitivities by noise injection and a least-squares fit.
    Data-free (KL to the model's own samples) unless `text_file` or `dataset` gives text."""

    num_seqs: int = 256  # evaluation sequences
    seq_len: int = 512  # tokens per sequence
    levels: int = 2  # noise levels t = t_max·i/levels, i = 1..levels (2 move plans by ~0.05%: docs/method.md §4)
    t_max: float = 1.0  # the largest noise norm, relative to the weight's norm
    directions: str = "shared"  # shared: one noise direction per layer over the levels; fresh: one per level
    loss: str = "auto"  # auto: kl data-free, ce on text; kl; ce
    seed: int = 0  # of the sampled sequences and of the noise
    dataset: str | None = None  # data-aware: a `datasets` NAME[:CONFIG[:SPLIT]]
    text_file: str | None = None  # data-aware: a UTF-8 text file
    layers: str | None = None  # only layers whose name matches this regex
    targets: list[str] | None = None  # regexes of the quantizable layers (None: every block's linear layer)
    ignore: list[str] | None = None  # regexes of layers left 16-bit (None: MoE routers; []: none)
    batch_size: int = 0  # sequences per forward pass (0: automatic); does not change the result
    dtype: str = "auto"  # auto (cpu float32, cuda bfloat16), float32, tf32, bfloat16, float16


@dataclass(kw_only=True)
class PlanConfig(Config):
    """`qpalette plan`: one palette entry per layer, minimising the predicted loss under budgets."""

    budget: list[str] = field(default_factory=list)  # "3.25bits", "2.4GB", "200tok/s", "5ms"; all must hold
    palette: list[str] | None = None  # families and/or entries (None: the whole palette)
    fuse: bool = True  # fused q/k/v and gate/up groups
    batch_size: int | None = None  # the decode batch size a speed budget is for (the profile's)
    time_limit_s: float = 60.0  # the integer program's time limit
    lm_head: str = "auto"  # auto (quantized under a speed budget when the inputs cover it), quantize, keep
    targets: list[str] | None = None  # regexes of the layers to plan for (None: every block's linear layer)
    ignore: list[str] | None = None  # regexes of layers left 16-bit (None: MoE routers; []: none)


@dataclass(kw_only=True)
class CompressConfig(Config):
    """`qpalette compress` and `qpalette.quantize`: how layers are rotated, quantized and stored.
    `scheme` is one palette entry for every layer (None when a plan file chooses per layer)."""

    scheme: str | None = None
    fuse: bool = True  # store fused groups (q/k/v, gate/up) as one matrix
    sign_seed: int = 0  # of the random sign vectors of the rotation
    lm_head: bool = False  # with a scheme: quantize lm_head too (a plan says for itself)
    damp: float = 0.01  # with Hessians: LDLQ's damping, a fraction of the mean diagonal of H
    targets: list[str] | None = None  # regexes of the layers to quantize (None: a plan's, or every block's linear layer)
    ignore: list[str] | None = None  # regexes of layers left 16-bit (None: a plan's, or MoE routers; []: none)


def _matches(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_text(hint) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
