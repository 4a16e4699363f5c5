"""Plan or scheme → the checkpoint layout: each layer's palette entry, the fused groups, the sign seed."""

from __future__ import annotations

from pathlib import Path

from qpalette.errors import CompressError, ModelError, UnknownQuantizer, UnsupportedShape
from qpalette.models.topology import (
    GROUP_MODULES,
    LayerShape,
    group_key,
    group_module,
    head_layer,
    linear_layers,
)
from qpalette.planning.document import Plan
from qpalette.quant.hadamard import decompose
from qpalette.quant.palette import get_quantizer
from qpalette.runtime.checkpoint import Layout


def layout_from_scheme(scheme: str, layers: list[LayerShape], fuse: bool, seed: int) -> Layout:
    q = get_quantizer(scheme).name
    groups: dict[str, list[str]] = {}
    if fuse:  # the layers of one input group fuse when their kinds make a group (q, k, v; gate, up)
        by_input: dict[tuple[int, str], list[LayerShape]] = {}
        for l in layers:
            by_input.setdefault((l.block, l.input_group), []).append(l)
        for members in by_input.values():
            kinds = [m.kind for m in members]
            if len(members) > 1 and group_key(kinds) in GROUP_MODULES:
                groups[group_module(members[0].name, kinds)] = [m.name for m in members]
    return Layout({l.name: q for l in layers}, groups, seed)


def layout_from_plan(path: Path, layers: list[LayerShape], fuse: bool, seed: int,
                     head: LayerShape | None = None) -> tuple[Layout, Plan]:
    """The layout a plan file asks for (lm_head `head` quantized if the plan names it); refuses a
    plan made for another model."""
    plan = Plan.load(path)
    known = {l.name: l for l in layers + ([head] if head is not None else [])}
    extra = sorted(set(plan.layers) - set(known))
    missing = sorted({l.name for l in layers} - set(plan.layers))
    if extra or missing:
        raise CompressError(
            f"plan {path} does not match the model: "
            + (f"layers not in the model: {extra[:3]}{'…' if len(extra) > 3 else ''}; " if extra else "")
            + (f"model layers missing from the plan: {missing[:3]}{'…' if len(missing) > 3 else ''}" if missing else "")
        )
    for name, entry in plan.layers.items():
        l = known[name]
        if list(entry.shape) != [l.out_features, l.in_features]:
            raise CompressError(
                f"plan {path}: {name} has shape {entry.shape} but the model's is "
                f"[{l.out_features}, {l.in_features}]; the plan was made for another model"
            )
    groups = {}
    if fuse:
        for g in (g for blk in plan.blocks for g in blk.groups if len(g.layers) > 1):
            groups[group_module(g.layers[0], [known[n].kind for n in g.layers])] = list(g.layers)
    try:
        return Layout(plan.assignment(), groups, seed), plan
    except (UnknownQuantizer, ValueError, KeyError) as e:
        raise CompressError(f"plan {path}: {e}") from None


def check_shapes(layout: Layout, layers: list[LayerShape]) -> None:
    """Every layer's shape must fit its quantizer's packed format and the Hadamard sizes."""
    problems = []
    for l in layers:
        try:
            get_quantizer(layout.layers[l.name]).check_shape(l.out_features, l.in_features)
            decompose(l.in_features)
        except UnsupportedShape as e:
            problems.append(f"{l.name} ({layout.layers[l.name]}): {e}")
    if problems:
        raise CompressError("unsupported layer shapes:\n  " + "\n  ".join(problems[:10]))




def plan_or_scheme(value: str | Path) -> tuple[str | None, Path | None]:
    """(scheme, plan file) of the library's `plan_or_scheme` argument: a plan file, or one palette
    entry for every layer (an unknown entry is refused with the palette's list)."""
    text = str(value)
    if Path(text).exists() or text.endswith(".json"):
        return None, Path(text)
    return get_quantizer(text).name, None


def resolve_layout(cfg: dict, scheme: str | None, plan_path: Path | None, lm_head: bool, fuse: bool, seed: int,
                   targets: list[str] | None = None, ignore: list[str] | None = None
                   ) -> tuple[Layout, Plan | None, list[LayerShape]]:
    """(layout, plan or None, the layers it quantizes) of a scheme or a plan file, shapes checked:
    what compress and the in-memory quantize both start from. The layers are chosen by
    `targets`/`ignore` (models/walk.py), by default those a plan was made with."""
    if lm_head and plan_path is not None:
        raise CompressError("--lm-head goes with --scheme; a plan says itself whether lm_head is quantized")
    try:
        if scheme:
            layers = linear_layers(cfg, lm_head, targets, ignore)
            layout, plan = layout_from_scheme(scheme, layers, fuse, seed), None
        else:
            chosen = Plan.load(plan_path).options
            layers = linear_layers(cfg, False, chosen.get("targets") if targets is None else targets,
                                   chosen.get("ignore") if ignore is None else ignore)
            layout, plan = layout_from_plan(plan_path, layers, fuse, seed, head_layer(cfg))
            layers = [l for l in layers + [head_layer(cfg)] if l.name in layout.layers]
    except UnknownQuantizer as e:
        raise CompressError(str(e)) from None
    except ModelError as e:
        raise CompressError(str(e)) from None
    check_shapes(layout, layers)
    return layout, plan, layers
