"""Mixed-scheme planning (docs/method.md §5): integer programs solved with SCIP through OR-Tools.

One formulation covers every budget. Per block, each *option* is a (fusion group, quantizer) pair:
the group is one layer ({q}, {down}, ...) or, when fusion is on and there is a latency budget, a
fused group ({q,k}, {k,v}, {q,v}, {q,k,v}, {gate,up}) whose layers share one quantizer and run as
one row-concatenated kernel call. Binary x_o per option:

    Σ_{o ∋ l} x_o = 1                                   every layer covered exactly once
    Σ x_o · Σ_{l∈o} n_l · bits(q_o)     ≤ B_bits · N      average nominal bits   (bits budget)
    Σ x_o · Σ_{l∈o} bytes(l, q_o) + Σ_c y_c · bytes(c) ≤ B_bytes − fixed          (byte budget)
    Σ_{o ∋ l, c ∈ cb(q_o)} x_o ≤ y_c   ∀ l, c          codebook c stored once if any layer uses it
    Σ x_o · latency(g_o, q_o) + constant_s − saving · Σ_b f_b ≤ B_s                (latency budget)
    f_b ≤ Σ_{o ∈ F_b^g} x_o  for g = qkv, gateup, down,  0 ≤ f_b ≤ 1             (fused blocks)
    minimise Σ x_o · Σ_{l∈o} a_l · err(q_o)      (or Σ x_o · Σ_{l∈o} table[l][q_o] with a loss table)

`fixed` = sign vectors (one per input group per block) + unquantized modules (fp16). Without a
latency budget only single-layer options exist (fusion changes no byte), and the fusion groups
of the plan are chosen afterwards: the fastest partition by the latency profile, else the largest
groups whose layers got the same quantizer.

A block whose q/k/v and gate/up are fused groups and whose qkv, gateup and down entries can form
their inputs in the GEMV (F_b^g: `takes_block_fusion`) runs its residual adds and norms inside those
GEMVs and saves the profile's `fused_block_saving_s`; f_b is then 1 at the optimum (it only relaxes
the budget), 0 otherwise.

Options dominated in every active resource (codebook bytes included) and in distortion are
dropped before solving; this never changes the optimum. Resource sums of the returned plan are
re-checked in exact arithmetic (integers for bits and bytes); if solver tolerances let a budget
be exceeded by a few units, the budget is tightened by the excess and the program re-solved. The
latency budget (continuous data) is tightened up front by SCIP's relative feasibility tolerance
(1e-9), so a plan within 1e-9 of it counts as over budget.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from qpalette.errors import InfeasibleBudget, InputError, ModelError, PlanError, UnsupportedShape
from qpalette.models.experts import is_expert_layer
from qpalette.models.topology import (
    FUSED_GROUPS,
    GROUPS,
    SINGLE_GROUPS,
    UNQUANTIZED_BYTES_PER_PARAM,
    LayerShape,
    group_members,
    sign_vector_bytes,
    units,
)
from qpalette.planning.budget import Budget
from qpalette.planning.inputs import LatencyProfile
from qpalette.quant.codebooks import codebook
from qpalette.quant.palette import Quantizer

RESOURCES = ("bits", "bytes", "latency")
FEASTOL = 1e-9  # SCIP's (relative) feasibility tolerance


@dataclass(frozen=True)
class Option:
    block: int
    group: str
    layers: tuple[int, ...]  # indices into Problem.layers
    quantizer: str
    loss: float  # Σ a_l err(q)
    qbits: int  # Σ n_l · 4·bits(q)   (quarter-bits: every palette entry's bits × 4 is an integer)
    nbytes: int  # Σ stored_bytes(l, q): codes + fp16 row scales
    latency: float | None  # seconds per decode step for this block's kernel call
    codebooks: tuple[str, ...]


@dataclass
class Problem:
    layers: list[LayerShape]
    a: list[float]
    quantizers: dict[str, Quantizer]
    err: dict[str, float]
    options: list[Option]
    codebook_bytes: dict[str, int]
    fixed_bytes: int | None  # sign vectors + unquantized modules; None if unknown
    sign_bytes: int
    unquantized_bytes: int | None
    latency: LatencyProfile | None
    fused: bool  # fused options offered
    pruned: int = 0
    notes: list[str] = field(default_factory=list)
    losses: list[dict[str, float]] | None = None  # per layer: entry → measured Δloss (a loss table)

    def layer_loss(self, i: int, quantizer: str) -> float:
        """Predicted loss of layer i with an entry: the table's, else a_l · err(q)."""
        return self.losses[i][quantizer] if self.losses is not None else self.a[i] * self.err[quantizer]

    @property
    def total_params(self) -> int:
        return sum(l.numel for l in self.layers)

    @property
    def block_saving(self) -> float:
        """Seconds a fused block saves (`fused_blocks`); blocks fuse only where fused groups are offered."""
        return self.latency.fused_block_saving_s if self.fused and self.latency is not None else 0.0

    @property
    def batch(self) -> int:
        """The batch the latency profile was measured at (which blocks fuse depends on it)."""
        return self.latency.batch_size if self.latency is not None else 1

    def fused_blocks(self, chosen: list[Option]) -> set[int]:
        return fused_blocks(((o.block, o.group, o.quantizer, self.layers[o.layers[0]].in_features) for o in chosen),
                            self.batch)


#: a block's calls that take its elementwise work when it fuses (runtime.modules.install_fused_block):
#: q/k/v's applies the input norm, gate/up's adds the residual and applies the second norm, down's
#: forms silu(gate) ⊙ up and adds the residual
FUSED_BLOCK_GROUPS = ("qkv", "gateup", "down")


def takes_block_fusion(group: str, quantizer: str, in_features: int, batch: int = 1) -> bool:
    """Whether a block's `group` call with this entry and input size takes its part of a fused block
    at this batch: the runtime's rule, `ops.forms_block_input` (down gated, q/k/v and gate/up normed)."""
    from qpalette.runtime import ops

    return group in FUSED_BLOCK_GROUPS and ops.forms_block_input(quantizer, in_features, batch, group != "down")


def fused_blocks(calls, batch: int = 1) -> set[int]:
    """Blocks all of whose FUSED_BLOCK_GROUPS calls take the fusion at this batch, of (block, group,
    entry, in_features) calls."""
    parts: dict[int, set[str]] = defaultdict(set)
    for block, group, quantizer, in_features in calls:
        if takes_block_fusion(group, quantizer, in_features, batch):
            parts[block].add(group)
    return {b for b, groups in parts.items() if len(groups) == len(FUSED_BLOCK_GROUPS)}


def _quarter_bits(q: Quantizer) -> int:
    qb = q.bits * 4
    if abs(qb - round(qb)) > 1e-9:
        raise PlanError(f"{q.name}: bits {q.bits} is not a multiple of 1/4")
    return int(round(qb))


def codebook_nbytes(name: str) -> int:
    return codebook(name).numel() * 2  # stored once per checkpoint, fp16


def check_latency_profile(profile: LatencyProfile, layers: list[LayerShape]) -> None:
    """Profile shapes must equal the model's (row-concatenated) group shapes in every block."""
    for g, (pout, pin) in profile.shapes.items():
        for b, kinds in ((b, kinds) for b, parents in _units(layers).items() for kinds in parents.values()):
            member_kinds = group_members(g, kinds)
            if member_kinds is None:
                continue
            members = [layers[kinds[k]] for k in member_kinds]
            ins = {m.in_features for m in members}
            shape = (sum(m.out_features for m in members), ins.pop())
            if shape != (pout, pin):
                raise InputError(
                    f"latency profile {profile.path} does not match the model: group {g} is "
                    f"{pout}×{pin} in the profile but {shape[0]}×{shape[1]} in block {b} "
                    f"(profile model: {profile.model})"
                )


def build_problem(
    layers: list[LayerShape],
    a: list[float],
    quantizers: list[Quantizer],
    err: dict[str, float],
    *,
    latency: LatencyProfile | None = None,
    use_latency: bool = False,
    fuse: bool = True,
    unquantized_params: int | None = None,
    active: tuple[str, ...] = RESOURCES,
    prune: bool = True,
    losses: list[dict[str, float]] | None = None,
) -> Problem:
    """Options of every block. `use_latency`: a latency budget exists (options need a latency,
    fused groups are offered when `fuse`). `losses` (per layer, entry → Δloss: a loss table) replace
    a_l · err(q) in the objective; an entry missing from a layer's row is no option for it."""
    _check_inputs(layers, a, quantizers, err, latency, use_latency)
    if losses is not None and len(losses) != len(layers):
        raise PlanError("one loss-table row per layer expected")
    groups, notes = _offered_groups(layers, latency, use_latency, fuse)
    cb_bytes = {c: codebook_nbytes(c) for q in quantizers for c in q.codebooks}
    saving = latency.fused_block_saving_s if latency is not None and use_latency and fuse else 0.0
    maker = _OptionMaker(layers, a, quantizers, err, cb_bytes, latency, use_latency, active, prune, losses, saving)
    options = [o for b, parents in sorted(_units(layers).items()) for g in groups
               for kinds in parents.values() for o in maker.options(b, g, kinds)]
    _check_covered(layers, options, use_latency)
    sign = sign_vector_bytes(layers)
    unq = None if unquantized_params is None else unquantized_params * UNQUANTIZED_BYTES_PER_PARAM
    fixed = None if unq is None else sign + unq
    return Problem(
        layers, list(a), {q.name: q for q in quantizers}, dict(err), options, cb_bytes, fixed, sign,
        unq, latency, use_latency and fuse, maker.pruned, notes, losses,
    )


def _check_inputs(layers, a, quantizers, err, latency: LatencyProfile | None, use_latency: bool) -> None:
    if len(a) != len(layers):
        raise PlanError("one sensitivity per layer expected")
    missing = [q.name for q in quantizers if q.name not in err]
    if missing:
        raise InputError(f"the distortion table has no entry for {', '.join(missing)}")
    if use_latency and latency is None:
        raise PlanError("a speed budget needs a latency profile (--latency-profile)")
    routed = next((l.name for l in layers if is_expert_layer(l.name)), None)
    if use_latency and routed:
        raise PlanError(f"speed budgets are not modelled for mixture-of-experts models ({routed} is an "
                        "expert): a token runs only the experts its router picks, in one grouped launch, "
                        "which a sum of per-layer latencies does not describe; plan with a bits or bytes budget")
    if latency is not None:
        check_latency_profile(latency, layers)


def _offered_groups(layers, latency: LatencyProfile | None, use_latency: bool, fuse: bool) -> tuple[list[str], list[str]]:
    """(groups options are made for, notes): single layers; the fused groups the profile times
    when there is a latency budget and fusion is on. Every single group of the model must be timed."""
    notes: list[str] = []
    kinds_present = list(dict.fromkeys(l.kind for l in layers))
    if use_latency:
        absent = [g for g in kinds_present if g not in latency.groups]
        if absent:
            raise InputError(
                f"latency profile {latency.path} has no latencies for group(s) {', '.join(absent)}"
            )
    groups = list(dict.fromkeys(SINGLE_GROUPS + tuple(kinds_present)))
    if use_latency and fuse:
        groups += [g for g in FUSED_GROUPS if g in latency.groups and g not in groups]
        lacking = [g for g in FUSED_GROUPS if g not in latency.groups]
        if lacking:
            notes.append(f"the latency profile has no fused group(s) {', '.join(lacking)}")
    return groups, notes


def _units(layers: list[LayerShape]) -> dict[int, dict[str, dict[str, int]]]:
    """block → parent module → kind → layer index (topology.units; one layer of each kind per parent)."""
    try:
        return units(layers)
    except ModelError as e:
        raise PlanError(str(e)) from None


@dataclass
class _OptionMaker:
    """Options of one (block, group): every quantizer that can hold the group's shapes (and has a
    latency for it under a speed budget), less the dominated ones. Stored sizes and the dominance
    test are cached per shape."""

    layers: list[LayerShape]
    a: list[float]
    quantizers: list[Quantizer]
    err: dict[str, float]
    cb_bytes: dict[str, int]
    latency: LatencyProfile | None
    use_latency: bool
    active: tuple[str, ...]
    prune: bool
    losses: list[dict[str, float]] | None = None
    block_saving: float = 0.0  # > 0: entries that let a block fuse are kept apart in the dominance test
    pruned: int = 0
    _stored: dict = field(default_factory=dict)  # (out, in, quantizer) → bytes | None (unsupported)
    _drop: dict = field(default_factory=dict)  # (group, shapes) → names of dominated quantizers

    def __post_init__(self):
        self._quarter = {q.name: _quarter_bits(q) for q in self.quantizers}

    def options(self, block: int, g: str, kinds: dict[str, int]) -> list[Option]:
        member_kinds = group_members(g, kinds)
        if member_kinds is None:
            return []
        idx = tuple(kinds[k] for k in member_kinds)
        members = [self.layers[i] for i in idx]
        if len({m.in_features for m in members}) != 1:
            return []  # not one concatenated matmul
        cand = self._candidates(g, idx, members)
        loss = {q.name: self._loss(idx, q.name) for q, *_ in cand}
        if self.prune and cand:
            # by shape with a_l·err(q) (err orders every group alike); per group with a loss table
            key = (g, tuple((m.out_features, m.in_features) for m in members)) if self.losses is None else (g, idx)
            if key not in self._drop:
                score = self.err if self.losses is None else loss
                fuses = {q.name for q, *_ in cand
                         if self.block_saving > 0 and takes_block_fusion(g, q.name, members[0].in_features,
                                                                         self.latency.batch_size)}
                self._drop[key] = _dominated(cand, score, self.cb_bytes, self.active, self.use_latency, fuses)
            self.pruned += sum(1 for c in cand if c[0].name in self._drop[key])
            cand = [c for c in cand if c[0].name not in self._drop[key]]
        return [Option(block, g, idx, q.name, loss[q.name], qb, nbytes, lat, q.codebooks)
                for q, nbytes, qb, lat in cand]

    def _loss(self, idx: tuple[int, ...], quantizer: str) -> float:
        if self.losses is None:
            return sum(self.a[i] for i in idx) * self.err[quantizer]
        return math.fsum(self.losses[i][quantizer] for i in idx)

    def _candidates(self, g: str, idx: tuple[int, ...], members: list[LayerShape]
                    ) -> list[tuple[Quantizer, int, int, float | None]]:
        """(quantizer, stored bytes, quarter-bits, latency) of every entry that fits the group (and,
        with a loss table, has a measured loss for each of its layers)."""
        out = []
        for q in self.quantizers:
            if self.losses is not None and any(q.name not in self.losses[i] for i in idx):
                continue
            sizes = [self.stored_bytes(m, q) for m in members]
            if any(s is None for s in sizes):
                continue
            lat = None
            if self.latency is not None:
                lat = self.latency.groups.get(g, {}).get(q.name)
                if self.use_latency and lat is None:
                    continue
            qb = sum(m.numel for m in members) * self._quarter[q.name]
            out.append((q, sum(sizes), qb, lat))
        return out

    def stored_bytes(self, l: LayerShape, q: Quantizer) -> int | None:
        key = (l.out_features, l.in_features, q.name)
        if key not in self._stored:
            try:
                self._stored[key] = q.stored_bytes(l.out_features, l.in_features)
            except UnsupportedShape:
                self._stored[key] = None
        return self._stored[key]


def _check_covered(layers: list[LayerShape], options: list[Option], use_latency: bool) -> None:
    covered = {i for o in options for i in o.layers}
    uncovered = [layers[i] for i in range(len(layers)) if i not in covered]
    if uncovered:
        l = uncovered[0]
        why = "no palette entry can hold its shape"
        if use_latency:
            why += " or has a latency in the profile for it"
        raise PlanError(
            f"layer {l.name} ({l.out_features}×{l.in_features}): {why}"
            + (f" (and {len(uncovered) - 1} more layers)" if len(uncovered) > 1 else "")
        )


def _dominated(cand, err, cb_bytes, active, use_latency, fuses=frozenset()) -> set[str]:
    """Names of candidates some other candidate beats (or ties, earlier wins) in every way; one in
    `fuses` (it lets its block fuse and save time) only by another in `fuses`."""
    drop = set()
    for j, (q, nb, qb, lat) in enumerate(cand):
        for k, (q2, nb2, qb2, lat2) in enumerate(cand):
            if k == j or q2.name in drop:
                continue
            worse = [err[q2.name] <= err[q.name], q.name not in fuses or q2.name in fuses]
            strict = [err[q2.name] < err[q.name]]
            if "bits" in active:
                worse.append(qb2 <= qb)
                strict.append(qb2 < qb)
            if "bytes" in active:
                nb2_full = nb2 + sum(cb_bytes[c] for c in q2.codebooks)
                worse.append(nb2_full <= nb)
                strict.append(nb2_full < nb)
            if use_latency and "latency" in active:
                worse.append(lat2 <= lat)
                strict.append(lat2 < lat)
            if all(worse) and (any(strict) or k < j):
                drop.add(q.name)
                break
    return drop


# -- solving ------------------------------------------------------------------------------------
@dataclass
class Solution:
    chosen: list[Option]
    status: str
    objective: float
    best_bound: float
    gap: float
    solve_time_s: float
    solver: str
    variables: int
    constraints: int
    resolves: int = 0


def _caps(problem: Problem, budgets: list[Budget]) -> dict[str, float | int]:
    caps: dict[str, float | int] = {}
    for bgt in budgets:
        if bgt.kind == "bits":
            caps["bits"] = math.floor(bgt.bits_fraction * 4 * problem.total_params)
        elif bgt.kind == "bytes":
            if problem.fixed_bytes is None:
                raise PlanError(
                    "a byte budget needs the model's config.json (embedding and norm sizes); "
                    "pass a model directory or config.json as MODEL"
                )
            caps["bytes"] = int(bgt.value) - problem.fixed_bytes
        else:
            if problem.latency is None:
                raise PlanError("a speed budget needs a latency profile (--latency-profile)")
            caps["latency"] = bgt.value - problem.latency.constant_s
    return caps


def usage(problem: Problem, chosen: list[Option]) -> dict[str, float | int]:
    """Exact resource use of chosen options (bytes exclude `fixed`; latency excludes constant)."""
    books = {c for o in chosen for c in o.codebooks}
    out: dict[str, float | int] = {
        "bits": sum(o.qbits for o in chosen),
        "bytes": sum(o.nbytes for o in chosen) + sum(problem.codebook_bytes[c] for c in books),
    }
    if all(o.latency is not None for o in chosen):
        out["latency"] = math.fsum(o.latency for o in chosen)
        if problem.block_saving:
            out["latency"] -= problem.block_saving * len(problem.fused_blocks(chosen))
    return out


def _scip_model(problem: Problem, caps: dict, objective: str = "loss", time_limit_s: float = 60.0):
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:
        raise PlanError("OR-Tools was built without SCIP")
    solver.SetTimeLimit(int(max(time_limit_s, 0.001) * 1000))
    solver.SetSolverSpecificParametersAsString(f"limits/gap = 0\nnumerics/feastol = {FEASTOL}\n")
    x = [solver.BoolVar(f"x{i}") for i in range(len(problem.options))]
    per_layer: list[list[int]] = [[] for _ in problem.layers]
    for i, o in enumerate(problem.options):
        for l in o.layers:
            per_layer[l].append(i)
    for l, idx in enumerate(per_layer):
        solver.Add(solver.Sum([x[i] for i in idx]) == 1)
    need_books = "bytes" in caps or objective == "bytes"
    y = {}
    if need_books:
        y = {c: solver.BoolVar(f"y[{c}]") for c in problem.codebook_bytes}
        for l, idx in enumerate(per_layer):
            for c in y:
                uses = [x[i] for i in idx if c in problem.options[i].codebooks]
                if uses:
                    solver.Add(solver.Sum(uses) <= y[c])
    # scaled units keep SCIP's numerics tame; exactness is re-checked in integers afterwards
    scale = {"bits": 4.0 * problem.total_params, "bytes": 1e6, "latency": 1e-6}
    exprs = {
        "bits": lambda: solver.Sum([(o.qbits / scale["bits"]) * x[i] for i, o in enumerate(problem.options)]),
        "bytes": lambda: solver.Sum(
            [(o.nbytes / scale["bytes"]) * x[i] for i, o in enumerate(problem.options)]
            + [(problem.codebook_bytes[c] / scale["bytes"]) * y[c] for c in y]
        ),
        "latency": lambda: solver.Sum(
            [(o.latency / scale["latency"]) * x[i] for i, o in enumerate(problem.options)]
            + [(-problem.block_saving / scale["latency"]) * f for f in _fused_block_vars(solver, problem, x)]
        ),
    }
    for r, cap in caps.items():
        rhs = cap / scale[r]
        if r == "latency":  # continuous data: keep SCIP's relative tolerance inside the budget
            rhs -= 1.01 * FEASTOL * max(1.0, abs(rhs))
        solver.Add(exprs[r]() <= rhs)
    if objective == "loss":
        solver.Minimize(solver.Sum([o.loss * x[i] for i, o in enumerate(problem.options)]))
    else:
        solver.Minimize(exprs[objective]())
    return solver, x, y, scale


def _fused_block_vars(solver, problem: Problem, x) -> list:
    """f_b ∈ [0, 1] per block that can fuse, each at most the chosen options' share of every
    FUSED_BLOCK_GROUPS call that takes the fusion (none without a saving)."""
    if problem.block_saving <= 0:
        return []
    takes: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, o in enumerate(problem.options):
        if takes_block_fusion(o.group, o.quantizer, problem.layers[o.layers[0]].in_features, problem.batch):
            takes[o.block][o.group].append(i)
    fs = []
    for b, by_group in sorted(takes.items()):
        if len(by_group) == len(FUSED_BLOCK_GROUPS):
            f = solver.NumVar(0.0, 1.0, f"f{b}")
            for idx in by_group.values():
                solver.Add(f <= solver.Sum([x[i] for i in idx]))
            fs.append(f)
    return fs


_STATUS = {0: "optimal", 1: "feasible", 2: "infeasible", 3: "unbounded", 4: "abnormal",
           5: "model_invalid", 6: "not_solved"}


def solve(problem: Problem, budgets: list[Budget], time_limit_s: float = 60.0) -> Solution:
    """Minimum predicted loss subject to the budgets; InfeasibleBudget if none fits."""
    if not budgets:
        raise PlanError("no budget given")
    caps = _caps(problem, budgets)
    for r in caps:
        if r == "latency" and any(o.latency is None for o in problem.options):
            raise PlanError("internal: latency budget on options without latencies")
    exact_caps = dict(caps)
    t0 = time.time()
    resolves = 0
    while True:
        solver, x, _, _ = _scip_model(problem, caps, "loss", time_limit_s - (time.time() - t0))
        status = solver.Solve()
        name = _STATUS.get(status, str(status))
        if name == "infeasible":
            raise _infeasible(problem, budgets, exact_caps, time_limit_s)
        if name not in ("optimal", "feasible"):
            if name == "not_solved":
                raise PlanError(
                    f"SCIP found no plan within the time limit ({time_limit_s:g} s); "
                    "raise --time-limit"
                )
            raise PlanError(f"SCIP returned status {name}")
        chosen = [o for i, o in enumerate(problem.options) if x[i].solution_value() > 0.5]
        use = usage(problem, chosen)
        excess = {r: use[r] - exact_caps[r] for r in exact_caps if use[r] > exact_caps[r] + (
            1e-12 if r == "latency" else 0)}
        if not excess or resolves >= 5:
            if excess:
                raise PlanError(f"solver tolerances: budget exceeded by {excess} after 5 re-solves")
            break
        resolves += 1
        for r, e in excess.items():
            caps[r] = caps[r] - 2 * e - (1e-12 if r == "latency" else 0)
    obj = solver.Objective().Value()
    bound = solver.Objective().BestBound()
    gap = abs(obj - bound) / abs(obj) if obj else 0.0
    if name == "optimal":
        gap = max(0.0, gap) if gap > 1e-9 else 0.0
    return Solution(
        chosen=sorted(chosen, key=lambda o: (o.block, min(o.layers))),
        status=name,
        objective=math.fsum(o.loss for o in chosen),
        best_bound=bound,
        gap=gap,
        solve_time_s=time.time() - t0,
        solver=f"SCIP {solver.SolverVersion()} via OR-Tools pywraplp",
        variables=solver.NumVariables(),
        constraints=solver.NumConstraints(),
        resolves=resolves,
    )


def minimum_resource(problem: Problem, resource: str, caps: dict, time_limit_s: float) -> float | None:
    """Smallest achievable use of `resource` (in budget units) subject to `caps`; None if none."""
    solver, x, y, scale = _scip_model(problem, caps, resource, time_limit_s)
    status = _STATUS.get(solver.Solve())
    if status not in ("optimal", "feasible"):
        return None
    chosen = [o for i, o in enumerate(problem.options) if x[i].solution_value() > 0.5]
    u = usage(problem, chosen)[resource]
    if status == "feasible":  # not proven: use the bound, rounded to be safe below
        u = min(u, solver.Objective().BestBound() * scale[resource])
    return u


def _to_budget_units(problem: Problem, resource: str, used: float) -> float:
    if resource == "bits":
        return used / (4 * problem.total_params)
    if resource == "bytes":
        return used + problem.fixed_bytes
    return used + problem.latency.constant_s


def _fmt(resource: str, v: float) -> str:
    if resource == "bits":
        return f"{math.ceil(v * 1e4) / 1e4:g} bits"
    if resource == "bytes":
        return f"{v / 1e9:.4f} GB ({int(math.ceil(v))} B, {v / 2**30:.4f} GiB)"
    return f"{1 / v:.2f} tok/s ({v * 1e3:.4f} ms per token)"


def _infeasible(problem, budgets, caps, time_limit_s) -> InfeasibleBudget:
    smallest, lines = {}, []
    what = {"bits": "smallest feasible is", "bytes": "smallest feasible is",
            "latency": "fastest feasible is"}
    for bgt in budgets:
        r = bgt.kind
        others = {k: v for k, v in caps.items() if k != r}
        alone_u = minimum_resource(problem, r, {}, time_limit_s)
        alone = None if alone_u is None else _to_budget_units(problem, r, alone_u)
        if not others:
            if alone is not None:
                smallest[r] = alone
                lines.append(f"{what[r]} {_fmt(r, alone)}")
            continue
        other_txt = ", ".join(b.text for b in budgets if b.kind != r)
        u = minimum_resource(problem, r, others, time_limit_s)
        if u is not None:
            v = _to_budget_units(problem, r, u)
            smallest[r] = v
            line = f"{bgt.text}: {what[r]} {_fmt(r, v)} with {other_txt}"
        else:
            line = f"{bgt.text}: no value is feasible with {other_txt}"
        if alone is not None:
            line += f"; on its own {_fmt(r, alone)}"
        lines.append(line)
    msg = "no plan fits the budget" + ("s " if len(budgets) > 1 else " ")
    msg += ", ".join(b.text for b in budgets)
    if len(budgets) == 1 and lines:
        msg += ": " + lines[0]
    elif lines:
        msg += ":\n" + "\n".join("  " + l for l in lines)
    return InfeasibleBudget(msg, smallest)


# -- fusion groups of a memory-only plan --------------------------------------------------------
_PARTITIONS = {
    "attn": [("q", "k", "v"), ("qkv",), ("qk", "v"), ("q", "kv"), ("qv", "k")],
    "mlp": [("gate", "up"), ("gateup",)],
}


def choose_groups(problem: Problem, assignment: dict[int, str], fuse: bool
                  ) -> list[tuple[int, str, str, tuple[int, ...]]]:
    """(block, group, quantizer, layer indices) for a per-layer assignment: fastest valid partition
    per parent module by the latency profile if there is one, else the largest same-quantizer groups."""
    out = []
    for b, parents in sorted(_units(problem.layers).items()):
        for u, kinds in enumerate(parents.values()):
            out += [(u, t) for t in _unit_groups(problem, b, kinds, assignment, fuse)]
    order = {g: i for i, g in enumerate(("q", "qk", "qv", "qkv", "k", "kv", "v", "o", "gate", "gateup", "up", "down", "head"))}
    return [t for _, t in sorted(out, key=lambda ut: (ut[1][0], ut[0], order.get(ut[1][1], len(order))))]


def _unit_groups(problem: Problem, b: int, kinds: dict[str, int], assignment: dict[int, str], fuse: bool
                 ) -> list[tuple[int, str, str, tuple[int, ...]]]:
    """choose_groups for the layers of one parent module (kind → layer index)."""
    fusable = {k for part in _PARTITIONS.values() for p in part for g in p for k in GROUPS[g]}
    out = [(b, k, assignment[i], (i,)) for k, i in kinds.items() if k not in fusable]
    prof = problem.latency
    for part in ("attn", "mlp"):
        best, best_key = None, None
        for partition in _PARTITIONS[part]:
            groups = _partition_groups(problem, partition, kinds, assignment, fuse)
            if groups is None:
                continue
            if prof is not None:
                lats = [prof.groups.get(g, {}).get(q) for g, q in groups]
                if any(t is None for t in lats):
                    continue
                key = (math.fsum(lats), len(groups))
            else:
                key = (len(groups),)
            if best_key is None or key < best_key:
                best, best_key = groups, key
        if best is None:  # profile lacks a latency: fall back to single layers
            best = [(k, assignment[kinds[k]]) for k in ("q", "k", "v", "gate", "up")
                    if k in kinds and (k in ("q", "k", "v")) == (part == "attn")]
        out += [(b, g, q, tuple(kinds[k] for k in GROUPS[g])) for g, q in best]
    return out


def _partition_groups(problem: Problem, partition, kinds: dict[str, int], assignment: dict[int, str],
                      fuse: bool) -> list[tuple[str, str]] | None:
    """(group, quantizer) of each group of `partition` present among `kinds`; None when the
    partition does not fit (a group partly present, mixed quantizers, fusion off, unequal inputs)."""
    groups = []
    for g in partition:
        members = GROUPS[g]
        present = [m for m in members if m in kinds]
        if not present:
            continue
        if len(present) != len(members):
            return None
        qs = {assignment[kinds[m]] for m in members}
        if len(qs) != 1 or (len(members) > 1 and not fuse):
            return None
        if len(members) > 1 and len({problem.layers[kinds[m]].in_features for m in members}) != 1:
            return None
        groups.append((g, qs.pop()))
    return groups


# -- the ideal-quantizer bound (docs/method.md §5 theorem) ------------------------------------------------
def ideal_allocation(a: list[float], n: list[int], total_bits: float, floor: float = 0.0) -> list[float]:
    """b_l* = max{η, ½·log2(a_l / n_l) + C} with C such that Σ b_l*·n_l = total_bits."""
    N = sum(n)
    if total_bits <= floor * N:
        return [floor] * len(a)
    pos = [i for i, ai in enumerate(a) if ai > 0]
    if not pos:
        return [total_bits / N] * len(a)
    base = [0.5 * math.log2(a[i] / n[i]) if a[i] > 0 else -math.inf for i in range(len(a))]

    def used(c: float) -> float:
        return math.fsum(max(floor, base[i] + c) * n[i] for i in range(len(a)))

    lo = floor - max(base[i] for i in pos)
    hi = lo + 1.0
    while used(hi) < total_bits:
        hi += 2 * (hi - lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        if used(mid) < total_bits:
            lo = mid
        else:
            hi = mid
    c = (lo + hi) / 2
    return [max(floor, base[i] + c) for i in range(len(a))]


def gap_decomposition(a: list[float], n: list[int], bits: list[float], err: list[float],
                      floor: float = 0.0) -> dict:
    """Plan loss = ideal loss + distortion gap + bit-allocation gap, at the plan's own total bits."""
    total = math.fsum(b * k for b, k in zip(bits, n))
    ideal_b = ideal_allocation(a, n, total, floor)
    ideal = math.fsum(ai * 2.0 ** (-2 * b) for ai, b in zip(a, ideal_b))
    dist = math.fsum(ai * (e - 2.0 ** (-2 * b)) for ai, e, b in zip(a, err, bits))
    alloc = math.fsum(ai * (2.0 ** (-2 * b) - 2.0 ** (-2 * bi)) for ai, b, bi in zip(a, bits, ideal_b))
    loss = math.fsum(ai * e for ai, e in zip(a, err))
    return {
        "avg_bits": total / sum(n),
        "floor_bits": floor,
        "ideal_loss": ideal,
        "plan_loss": loss,
        "distortion_gap": dist,
        "bit_allocation_gap": alloc,
        "ideal_bits": ideal_b,
    }


__all__ = [
    "Option", "Problem", "Solution", "build_problem", "check_latency_profile", "choose_groups",
    "gap_decomposition", "ideal_allocation", "minimum_resource", "solve", "usage",
]
