"""Plans (`qpalette.plan/1`): the typed `Plan` document, its readable tables, the bits-per-layer plot.

A plan (docs/method.md §5) records, per linear layer, the chosen palette entry and its predicted
loss; per block, the fusion groups (kernel calls); and the totals, the ideal-quantizer bound, the
solver's report and where the inputs came from. `Plan.to_dict()` is the JSON written by `qpalette
plan -o` (key order included), `Plan.from_dict` / `Plan.load` read it back and check `format`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from qpalette.config import PlanConfig
from qpalette.errors import InputError
from qpalette.fileio import atomic_write, read_json_object
from qpalette.planning.budget import Budget
from qpalette.planning.inputs import LatencyProfile
from qpalette.planning.program import Problem, Solution, choose_groups, fused_blocks, gap_decomposition, usage

PLAN_FORMAT = "qpalette.plan/1"
_HINT = "written by `qpalette plan`"


# -- the document -------------------------------------------------------------------------------
def _build(cls, d, where: str, **typed):
    """cls(**d) for a dataclass whose fields without a default must be in `d` (keys beyond them
    are ignored); `typed` overrides fields already converted by the caller."""
    if not isinstance(d, dict):
        raise InputError(f"{where}: expected an object, got {type(d).__name__}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in d]
    if missing:
        raise InputError(f"{where}: missing {', '.join(repr(n) for n in missing)} ({_HINT})")
    return cls(**{f.name: typed[f.name] if f.name in typed else d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class PlanLayer:
    """One linear layer: its palette entry, shape, fusion group, stored bytes and predicted loss."""

    quantizer: str
    family: str
    bits: float
    shape: list[int]  # [out_features, in_features]
    block: int
    kind: str
    group: str  # the fusion group (kernel call) the layer is part of
    bytes: int  # codes + fp16 row scales
    a: float  # sensitivity a_l
    err: float  # distortion err(q) of its entry
    loss: float  # a · err, or the loss table's measured Δloss
    ideal_bits: float  # b_l* of the ideal-quantizer bound

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan layer") -> "PlanLayer":
        return _build(cls, d, where)


@dataclass
class PlanGroup:
    """One kernel call of a block: a fusion group and the one quantizer its layers share."""

    group: str
    quantizer: str
    layers: list[str]
    latency_s: float | None  # from the latency profile; None without one

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan group") -> "PlanGroup":
        return _build(cls, d, where)


@dataclass
class PlanBlock:
    block: int
    groups: list[PlanGroup]
    latency_s: float | None  # Σ of its groups' latencies; None if any is unknown

    def to_dict(self) -> dict:
        return {"block": self.block, "groups": [g.to_dict() for g in self.groups],
                "latency_s": self.latency_s}

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan block") -> "PlanBlock":
        groups = d.get("groups") if isinstance(d, dict) else None
        if not isinstance(groups, list):
            raise InputError(f"{where}: 'groups' must be a list")
        return _build(cls, d, where, groups=[PlanGroup.from_dict(g, f"{where} group {i}")
                                             for i, g in enumerate(groups)])


@dataclass
class Plan:
    """A `qpalette.plan/1` document. `model`, `options`, `totals`, `bound`, `solver` and
    `provenance` are free-form objects (see docs/format.md for their keys)."""

    model: dict
    budgets: list[Budget]
    options: dict
    totals: dict  # predicted_loss, avg_bits, bytes{...}, latency_s, tok_per_s, ...
    bound: dict  # gap_decomposition(): ideal_loss, distortion_gap, bit_allocation_gap, ...
    solver: dict  # name, status, objective, best_bound, gap, solve_time_s, ...
    codebooks: list[str]
    layers: dict[str, PlanLayer]
    blocks: list[PlanBlock]
    provenance: dict  # the inputs (paths, sha256), versions, command, wall time
    notes: list[str] = field(default_factory=list)
    config: PlanConfig | None = None  # the recipe as given (None in plans written before it was recorded)
    format: str = PLAN_FORMAT

    def to_dict(self) -> dict:
        recipe = {"config": self.config.to_dict()} if self.config else {}  # older plans have none
        return {
            "format": self.format,
            "model": self.model,
            **recipe,
            "budgets": [b.to_dict() for b in self.budgets],
            "options": self.options,
            "totals": self.totals,
            "bound": self.bound,
            "solver": self.solver,
            "codebooks": self.codebooks,
            "layers": {n: v.to_dict() for n, v in self.layers.items()},
            "blocks": [b.to_dict() for b in self.blocks],
            "provenance": self.provenance,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise InputError(f"{where}: a plan is a JSON object, not {type(d).__name__}")
        if d.get("format") != PLAN_FORMAT:
            raise InputError(f"{where}: format is {d.get('format')!r}, expected {PLAN_FORMAT!r} ({_HINT})")
        for key, kind in (("budgets", list), ("layers", dict), ("blocks", list)):
            if not isinstance(d.get(key), kind):
                raise InputError(f"{where}: {key!r} must be a JSON {kind.__name__.replace('dict', 'object')}")
        return _build(
            cls, d, where,
            budgets=[Budget.from_dict(b, f"{where}: budget {i}") for i, b in enumerate(d["budgets"])],
            layers={n: PlanLayer.from_dict(v, f"{where}: layer {n}") for n, v in d["layers"].items()},
            blocks=[PlanBlock.from_dict(b, f"{where}: block {i}") for i, b in enumerate(d["blocks"])],
            config=PlanConfig.from_dict(d["config"], f"{where}: config") if d.get("config") is not None else None,
        )

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json_object(path, "plan", InputError, PLAN_FORMAT, _HINT), str(path))

    def save(self, path: str | Path) -> None:
        """Atomically write the JSON (indent 1, trailing newline), as `qpalette plan -o` does."""
        atomic_write(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def assignment(self) -> dict[str, str]:
        """Layer name → palette entry name."""
        return {n: v.quantizer for n, v in self.layers.items()}


def write_plan(plan: Plan, path: str | Path) -> None:
    """`plan.save(path)` (kept for qpalette/api.py)."""
    plan.save(path)


def load_plan(path: str | Path) -> Plan:
    """`Plan.load(path)` (kept for qpalette/api.py)."""
    return Plan.load(path)


# -- making a plan from a solution --------------------------------------------------------------
def make_plan(
    problem: Problem,
    solution: Solution,
    budgets: list[Budget],
    *,
    fuse: bool,
    model: dict,
    inputs: dict,
    options: dict,
    notes: list[str] | None = None,
    config: PlanConfig | None = None,
) -> Plan:
    """The plan document of a solved problem: per-layer rows, per-block fusion groups, totals,
    the ideal-quantizer bound (docs/method.md §5) and the solver's report."""
    assignment = {i: o.quantizer for o in solution.chosen for i in o.layers}
    group_of = {i: o.group for o in solution.chosen for i in o.layers}
    if problem.fused or not fuse:
        triples = [(o.block, o.group, o.quantizer, o.layers) for o in solution.chosen]
    else:
        triples = choose_groups(problem, assignment, fuse)
    blocks = _plan_blocks(problem, triples, group_of)
    layers, bound = _plan_layers(problem, assignment, group_of)
    books = sorted({c for q in set(assignment.values()) for c in problem.quantizers[q].codebooks})
    return Plan(
        model=model,
        budgets=list(budgets),
        options=options,
        totals=_totals(problem, solution, layers, blocks, books),
        bound=bound,
        solver=_solver_report(problem, solution),
        codebooks=books,
        layers=layers,
        blocks=blocks,
        provenance=inputs,
        notes=list(problem.notes) + list(notes or []) + _latency_notes(problem.latency, triples),
        config=config,
    )


def _plan_blocks(problem: Problem, triples: list[tuple[int, str, str, tuple[int, ...]]], group_of: dict[int, str]
                 ) -> list[PlanBlock]:
    """PlanBlocks (block order) of the (block, group, quantizer) kernel calls; records each
    layer's group in `group_of`."""
    layers, prof = problem.layers, problem.latency
    blocks: dict[int, PlanBlock] = {}
    for b, g, q, members in triples:
        for i in members:
            group_of[i] = g
        lat = prof.groups.get(g, {}).get(q) if prof else None
        blk = blocks.setdefault(b, PlanBlock(b, [], None))
        blk.groups.append(PlanGroup(g, q, [layers[i].name for i in members], lat))
    for blk in blocks.values():
        lats = [g.latency_s for g in blk.groups]
        blk.latency_s = None if any(t is None for t in lats) else math.fsum(lats)
    return [blocks[b] for b in sorted(blocks)]


def _plan_layers(problem: Problem, assignment: dict[int, str], group_of: dict[int, str]) -> tuple[dict[str, PlanLayer], dict]:
    """Per-layer rows and the ideal-quantizer bound (whose b_l* the rows carry)."""
    layers, qs = problem.layers, problem.quantizers
    n = [l.numel for l in layers]
    bits = [qs[assignment[i]].bits for i in range(len(layers))]
    err = [problem.err[assignment[i]] for i in range(len(layers))]
    bound = gap_decomposition(problem.a, n, bits, err)
    ideal_bits = bound.pop("ideal_bits")
    rows = {}
    for i, l in enumerate(layers):
        q = qs[assignment[i]]
        rows[l.name] = PlanLayer(
            quantizer=q.name, family=q.family, bits=q.bits, shape=[l.out_features, l.in_features],
            block=l.block, kind=l.kind, group=group_of[i],
            bytes=q.stored_bytes(l.out_features, l.in_features),
            a=problem.a[i], err=err[i], loss=problem.layer_loss(i, q.name), ideal_bits=ideal_bits[i],
        )
    return rows, bound


def _totals(problem: Problem, solution: Solution, layers: dict[str, PlanLayer], blocks: list[PlanBlock],
            books: list[str]) -> dict:
    """Predicted loss, bits, bytes (every part of the checkpoint) and the predicted latency."""
    prof = problem.latency
    codes = sum(v.bytes for v in layers.values())
    cb = sum(problem.codebook_bytes[c] for c in books)
    total_bytes = None
    if problem.unquantized_bytes is not None:
        total_bytes = codes + cb + problem.sign_bytes + problem.unquantized_bytes
    latency, fused = None, set()
    if prof is not None and all(blk.latency_s is not None for blk in blocks):
        fused = fused_blocks(((blk.block, g.group, g.quantizer, layers[g.layers[0]].shape[1])
                              for blk in blocks for g in blk.groups), prof.batch_size)
        latency = math.fsum(blk.latency_s for blk in blocks) + prof.constant_s - prof.fused_block_saving_s * len(fused)
    return {
        "predicted_loss": math.fsum(v.loss for v in layers.values()),
        "avg_bits": usage(problem, solution.chosen)["bits"] / (4 * problem.total_params),
        "quantized_params": problem.total_params,
        "bytes": {
            "total": total_bytes,
            "codes_and_row_scales": codes,
            "codebooks": cb,
            "sign_vectors": problem.sign_bytes,
            "unquantized_modules": problem.unquantized_bytes,
        },
        "bytes_per_quantized_weight_bits": 8 * (codes + cb + problem.sign_bytes) / problem.total_params,
        "latency_s": latency,
        "fused_blocks": len(fused),  # blocks whose norms and adds run in their kernels (program.fused_blocks)
        "tok_per_s": None if latency is None else 1.0 / latency,
        "batch_size": prof.batch_size if prof else None,
        "throughput_tok_per_s": None if latency is None else prof.batch_size / latency,
    }


def _solver_report(problem: Problem, solution: Solution) -> dict:
    return {
        "name": solution.solver,
        "status": solution.status,
        "objective": solution.objective,
        "best_bound": solution.best_bound,
        "gap": solution.gap,
        "solve_time_s": solution.solve_time_s,
        "variables": solution.variables,
        "constraints": solution.constraints,
        "options_pruned_as_dominated": problem.pruned,
        "tolerance_resolves": solution.resolves,
    }


def _latency_notes(prof: LatencyProfile | None, triples: list[tuple[int, str, str, tuple[int, ...]]]) -> list[str]:
    """A note naming the kernel calls the profile has no time for (the plan then has no latency)."""
    if prof is None:
        return []
    untimed = sorted({f"{g}/{q}" for _, g, q, _ in triples if prof.groups.get(g, {}).get(q) is None})
    if not untimed:
        return []
    return [f"no predicted latency: the latency profile has no time for {', '.join(untimed[:8])}"
            + (" …" if len(untimed) > 8 else "")]


# -- text ---------------------------------------------------------------------------------------
def _bytes(v) -> str:
    if v is None:
        return "unknown"
    return f"{v:,} B ({v / 1e9:.4f} GB)"


def summary(plan: Plan) -> str:
    t, s, g = plan.totals, plan.solver, plan.bound
    by = t["bytes"]
    lines = [
        f"plan for {plan.model.get('name') or plan.model.get('source')}: "
        f"{len(plan.layers)} linear layers in {sum(all('lm_head' not in g.layers for g in b.groups) for b in plan.blocks)} blocks"
        + (" and lm_head" if "lm_head" in plan.layers else ""),
        "budgets: " + ", ".join(b.text for b in plan.budgets),
        f"solver: {s['name']}: {s['status']}, gap {s['gap']:.2e}, {s['solve_time_s']:.2f} s "
        f"({s['variables']} variables, {s['constraints']} constraints, "
        f"{s['options_pruned_as_dominated']} dominated options dropped)",
        f"predicted loss increase: {t['predicted_loss']:.6g}",
        f"average bits: {t['avg_bits']:.4f} nominal; {t['bytes_per_quantized_weight_bits']:.4f} "
        "with row scales, codebooks and sign vectors",
        f"bytes: total {_bytes(by['total'])} = codes+scales {by['codes_and_row_scales']:,} + "
        f"codebooks {by['codebooks']:,} + sign vectors {by['sign_vectors']:,} + unquantized "
        + ("unknown" if by["unquantized_modules"] is None else f"{by['unquantized_modules']:,}"),
    ]
    if t["latency_s"] is not None:
        lines.append(
            f"predicted latency: {t['latency_s'] * 1e3:.4f} ms/token = {t['tok_per_s']:.2f} tok/s "
            f"(batch {t['batch_size']}" + (f"; {t['fused_blocks']} blocks run their norms and adds inside their "
                                           "kernels)" if t.get("fused_blocks") else ")")
        )
    else:
        given = (plan.provenance or {}).get("latency_profile")
        lines.append("predicted latency: " + ("unavailable (see note)" if given else "no latency profile given"))
    lines.append(
        f"ideal-quantizer bound at {g['avg_bits']:.4f} bits: {g['ideal_loss']:.6g}; plan − bound = "
        f"distortion gap {g['distortion_gap']:.6g} + bit-allocation gap {g['bit_allocation_gap']:.6g}"
    )
    if s["status"] != "optimal":
        lines.append(
            f"warning: SCIP stopped at the time limit; the plan is feasible but not proven optimal "
            f"(relative gap {s['gap']:.2e}); raise --time-limit to close it"
        )
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def block_table(plan: Plan) -> str:
    """One line per block: each layer's quantizer and the fusion groups."""
    kinds = tuple(dict.fromkeys(v.kind for v in plan.layers.values() if v.kind != "head"))
    rows = {}
    for v in plan.layers.values():
        rows.setdefault(v.block, {})[v.kind] = v.quantizer
    head = f"{'blk':>3} " + " ".join(f"{k:>13}" for k in kinds) + "  groups"
    out = [head]
    for blk in plan.blocks:
        b = blk.block
        if "head" in rows[b]:
            out.append(f"{b:>3} lm_head {rows[b]['head']}")
            continue
        groups = " ".join(g.group for g in blk.groups if len(g.layers) > 1)
        out.append(f"{b:>3} " + " ".join(f"{rows[b].get(k, '-'):>13}" for k in kinds)
                   + f"  {groups or '-'}")
    return "\n".join(out)


def layer_table(plan: Plan) -> str:
    lines = [f"{'layer':<36} {'shape':>11} {'quantizer':>13} {'group':>6} {'bits':>5} "
             f"{'ideal b*':>8} {'a_l':>10} {'err':>9} {'loss':>10} {'bytes':>11}"]
    for name, v in plan.layers.items():
        shape = f"{v.shape[0]}×{v.shape[1]}"
        lines.append(
            f"{name:<36} {shape:>11} {v.quantizer:>13} {v.group:>6} {v.bits:5.2f} "
            f"{v.ideal_bits:8.3f} {v.a:10.4g} {v.err:9.3g} {v.loss:10.4g} {v.bytes:>11,}"
        )
    return "\n".join(lines)


# -- plot ---------------------------------------------------------------------------------------
_COLORS = {"nuq": "tab:green", "vq": "tab:orange", "tcq": "tab:blue", "half-tcq": "tab:purple"}


def plot_plan(plan: Plan, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(plan.layers)
    v = list(plan.layers.values())
    fig, ax = plt.subplots(figsize=(max(8, min(40, len(names) * 0.06)), 4))
    xs = range(len(names))
    ax.bar(xs, [r.bits for r in v], width=1.0, color=[_COLORS.get(r.family, "gray") for r in v])
    ax.plot(xs, [r.ideal_bits for r in v], color="black", lw=0.8, label="ideal b* (theorem)")
    for fam, c in _COLORS.items():
        if any(r.family == fam for r in v):
            ax.bar([0], [0], color=c, label=fam)
    t = plan.totals
    title = f"{plan.model.get('name') or ''}  budgets {', '.join(b.text for b in plan.budgets)}: " \
            f"avg {t['avg_bits']:.3f} bits, loss {t['predicted_loss']:.4g}"
    if t["tok_per_s"]:
        title += f", {t['tok_per_s']:.1f} tok/s"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("linear layer (block order: q k v o gate up down)")
    ax.set_ylabel("bits per weight")
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
