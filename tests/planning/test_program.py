"""Planner: SCIP plans equal brute-force optima on tiny instances; budgets hold exactly."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from helpers import block_covers, exhaustive

from qpalette.errors import InfeasibleBudget, PlanError
from qpalette.models.topology import (
    FUSED_GROUPS,
    GROUPS,
    SINGLE_GROUPS,
    linear_layers,
    sign_vector_bytes,
    unquantized_params,
)
from qpalette.planning.budget import Budget, parse_budgets
from qpalette.planning.document import make_plan
from qpalette.planning.inputs import LatencyProfile
from qpalette.planning.program import build_problem, gap_decomposition, ideal_allocation, solve, usage
from qpalette.quant.codebooks import codebook
from qpalette.quant.distortion import DistortionTable
from qpalette.quant.palette import get_quantizer

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 100,
    "tie_word_embeddings": False,
}
ERR = {k: v.nmse for k, v in DistortionTable.load().rows.items()}


def tiny_layers(blocks=1, **over):
    return linear_layers(TINY | {"num_hidden_layers": blocks} | over)


def fake_profile(quantizers, seed, const=1e-3) -> LatencyProfile:
    rng = random.Random(seed)
    singles = {g: {q.name: rng.uniform(5e-6, 2e-5) for q in quantizers} for g in SINGLE_GROUPS}
    groups = dict(singles)
    for g in FUSED_GROUPS:  # a fused call is cheaper than its parts, by a random margin
        groups[g] = {
            q.name: sum(singles[k][q.name] for k in GROUPS[g]) * rng.uniform(0.55, 1.05)
            for q in quantizers
        }
    return LatencyProfile("fake.json", "0" * 64, "tiny", "fake", 1, const, groups, {})


def quantizers(names):
    return [get_quantizer(n) for n in names]


def budget_between(lo, hi, frac, kind):
    v = lo + frac * (hi - lo)
    if kind == "bits":
        return Budget("bits", v, f"{v:.6f}bits")
    if kind == "bytes":
        return Budget("bytes", float(int(v)), f"{int(v)}B")
    return Budget("latency", v, f"{v * 1e3:.9f}ms")


def random_budgets(full, budgets_kinds, rng, latency=None):
    """Budgets at random points between each resource's min and max over all covers."""
    uses = [usage(full, [o for c in combo for o in c]) for combo in itertools.product(*block_covers(full))]
    budgets = []
    for k in budgets_kinds:
        vals = [u[k] for u in uses]
        lo, hi = min(vals), max(vals)
        if k == "bits":
            lo, hi = lo / (4 * full.total_params), hi / (4 * full.total_params)
        elif k == "bytes":
            lo, hi = lo + full.fixed_bytes, hi + full.fixed_bytes
        else:
            lo, hi = lo + latency.constant_s, hi + latency.constant_s
        budgets.append(budget_between(lo, hi, rng.uniform(0.05, 0.6), k))
    return budgets


FORMS = {"tcq-2.0", "tcq-3.0"}  # of the entries below, those whose GEMV forms its input (not half-TCQ)


def fused_by_hand(chosen) -> set[int]:
    """Blocks whose qkv and gateup groups and down have entries in FORMS (counted apart from the planner)."""
    parts = {}
    for o in chosen:
        if o.group in ("qkv", "gateup", "down") and o.quantizer in FORMS:
            parts.setdefault(o.block, set()).add(o.group)
    return {b for b, g in parts.items() if len(g) == 3}


def assert_budgets_hold(layers, chosen, budgets, latency=None):
    """Budgets hold exactly, counted independently of the solver's bookkeeping."""
    assign = {i: o.quantizer for o in chosen for i in o.layers}
    assert sorted(assign) == list(range(len(layers)))
    for bgt in budgets:
        if bgt.kind == "bits":
            num = sum(l.numel * get_quantizer(assign[i]).bits for i, l in enumerate(layers))
            assert num / sum(l.numel for l in layers) <= bgt.value + 1e-12
        elif bgt.kind == "bytes":
            codes = sum(get_quantizer(assign[i]).stored_bytes(l.out_features, l.in_features)
                        for i, l in enumerate(layers))
            books = {c for q in assign.values() for c in get_quantizer(q).codebooks}
            total = codes + sum(codebook(c).numel() * 2 for c in books)
            total += sign_vector_bytes(layers) + 2 * 1000
            assert total <= bgt.value
        else:
            lat = math.fsum(latency.groups[o.group][o.quantizer] for o in chosen)
            lat -= latency.fused_block_saving_s * len(fused_by_hand(chosen))
            assert lat + latency.constant_s <= bgt.value * (1 + 1e-12)


def check_against_brute_force(layers, qs, budgets_kinds, seed, latency=None, fuse=True):
    rng = random.Random(seed)
    a = [rng.lognormvariate(-3, 2) for _ in layers]
    speed = "latency" in budgets_kinds
    kw = dict(latency=latency, use_latency=speed, fuse=fuse, unquantized_params=1000,
              active=tuple(budgets_kinds))
    full = build_problem(layers, a, qs, ERR, prune=False, **kw)
    pruned = build_problem(layers, a, qs, ERR, **kw)
    budgets = random_budgets(full, budgets_kinds, rng, latency)
    best = exhaustive(full, budgets)
    if best is None:
        with pytest.raises(InfeasibleBudget):
            solve(pruned, budgets)
        return None
    sol = solve(pruned, budgets)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best[0], rel=1e-9, abs=1e-15)
    assert_budgets_hold(layers, sol.chosen, budgets, latency)
    # fused groups carry one quantizer for all their layers
    for o in sol.chosen:
        assert len(o.layers) == len(GROUPS[o.group])
    return sol


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kinds", [("bits",), ("bytes",), ("bits", "bytes")])
def test_memory_plan_equals_brute_force(seed, kinds):
    # 1 block × 7 layers × 4 entries (two share the tcq.q9 table) = 16384 plans
    qs = quantizers(["tcq-2", "half-tcq-2.75", "vq-3", "nuq-4"])
    check_against_brute_force(tiny_layers(), qs, kinds, seed)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kinds", [("latency",), ("latency", "bytes"), ("latency", "bits")])
def test_speed_plan_with_fusion_equals_brute_force(seed, kinds):
    qs = quantizers(["tcq-2", "tcq-3", "vq-2.5"])
    prof = fake_profile(qs, seed)
    sol = check_against_brute_force(tiny_layers(), qs, kinds, seed, latency=prof)
    assert sol is None or sol.status == "optimal"


@pytest.mark.parametrize("seed", range(3))
def test_speed_plan_without_fusion_equals_brute_force(seed):
    qs = quantizers(["tcq-2", "tcq-3", "vq-2.5", "nuq-3"])
    prof = fake_profile(qs, seed)
    sol = check_against_brute_force(tiny_layers(), qs, ("latency",), seed, latency=prof, fuse=False)
    assert sol is None or all(len(o.layers) == 1 for o in sol.chosen)


def test_fusion_is_used_when_it_pays_and_groups_share_a_quantizer():
    qs = quantizers(["tcq-2", "tcq-3", "tcq-4"])
    prof = fake_profile(qs, 0)
    for g in FUSED_GROUPS:  # make fused calls much cheaper
        for q in prof.groups[g]:
            prof.groups[g][q] *= 0.3
    layers = tiny_layers(blocks=3)
    a = [1.0] * len(layers)
    problem = build_problem(layers, a, qs, ERR, latency=prof, use_latency=True,
                            unquantized_params=1000)
    budgets = [Budget("latency", prof.constant_s + 3 * 4e-5, "x")]
    sol = solve(problem, budgets)
    plan = make_plan(problem, sol, budgets, fuse=True, model={}, inputs={}, options={})
    seen = []
    for blk in plan.blocks:
        for g in blk.groups:
            assert {plan.layers[n].quantizer for n in g.layers} == {g.quantizer}
            seen += g.layers
    assert sorted(seen) == sorted(plan.layers)  # every layer in exactly one group
    assert any(len(g.layers) > 1 for blk in plan.blocks for g in blk.groups)


def test_unsupported_shapes_are_excluded():
    # in_features 48 is not a multiple of 32: half-TCQ cannot hold those layers
    layers = tiny_layers(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    qs = quantizers(["half-tcq-3.25", "tcq-3"])
    problem = build_problem(layers, [1.0] * len(layers), qs, ERR, unquantized_params=0)
    for o in problem.options:
        if layers[o.layers[0]].in_features == 48:
            assert o.quantizer == "tcq-3.0"
    sol = solve(problem, parse_budgets(["3.5bits"]))
    assert sol.status == "optimal"


def test_infeasible_budget_reports_smallest_feasible_which_then_solves():
    layers = tiny_layers(blocks=2)
    qs = quantizers(["tcq-2", "tcq-3", "vq-4"])
    a = [0.5] * len(layers)
    problem = build_problem(layers, a, qs, ERR, unquantized_params=1000)
    with pytest.raises(InfeasibleBudget) as e:
        solve(problem, parse_budgets(["1.5bits"]))
    assert "smallest feasible is 2 bits" in str(e.value)
    assert e.value.smallest["bits"] == pytest.approx(2.0)
    with pytest.raises(InfeasibleBudget) as e:
        solve(problem, parse_budgets(["100B"]))
    smallest = e.value.smallest["bytes"]
    sol = solve(problem, [Budget("bytes", float(math.ceil(smallest)), "x")])
    assert sol.status == "optimal"
    with pytest.raises(InfeasibleBudget):
        solve(problem, [Budget("bytes", float(math.ceil(smallest)) - 1, "x")])


def test_ideal_allocation_meets_total_and_equalises_marginals():
    rng = random.Random(1)
    a = [rng.lognormvariate(-3, 2) for _ in range(50)]
    n = [rng.choice([4096 * 4096, 1024 * 4096, 14336 * 4096]) for _ in range(50)]
    total = 3.0 * sum(n)
    b = ideal_allocation(a, n, total)
    assert math.fsum(bi * ni for bi, ni in zip(b, n)) == pytest.approx(total, rel=1e-12)
    marg = [ai / ni * 2 ** (-2 * bi) for ai, ni, bi in zip(a, n, b) if bi > 1e-9]
    assert max(marg) == pytest.approx(min(marg), rel=1e-6)
    # it is optimal: moving bits between two layers never lowers the loss
    loss = math.fsum(ai * 2 ** (-2 * bi) for ai, bi in zip(a, b))
    b2 = list(b)
    b2[0] += 0.1 * n[1] / n[0]
    b2[1] -= 0.1
    assert math.fsum(ai * 2 ** (-2 * bi) for ai, bi in zip(a, b2)) > loss


def test_gap_decomposition_adds_up():
    rng = random.Random(2)
    a = [rng.lognormvariate(-3, 2) for _ in range(30)]
    n = [4096 * 4096] * 30
    qs = [get_quantizer(rng.choice(["tcq-2", "tcq-3", "vq-3.5", "nuq-4"])) for _ in range(30)]
    g = gap_decomposition(a, n, [q.bits for q in qs], [ERR[q.name] for q in qs])
    assert g["plan_loss"] == pytest.approx(g["ideal_loss"] + g["distortion_gap"] + g["bit_allocation_gap"])
    assert g["distortion_gap"] > 0 and g["bit_allocation_gap"] >= -1e-12


def test_unquantized_and_sign_vector_bytes():
    cfg = TINY | {"num_hidden_layers": 2}
    layers = linear_layers(cfg)
    # per block: qkv (64), o (64), gate/up (64), down (96) → 8 + 8 + 8 + 12 bytes
    assert sign_vector_bytes(layers) == 2 * (8 + 8 + 8 + 12)
    unq = unquantized_params(cfg)
    assert unq == {"embed_tokens": 6400, "lm_head": 6400, "norms": 5 * 64}
    assert "lm_head" not in unquantized_params(cfg | {"tie_word_embeddings": True})


@pytest.mark.parametrize("with_profile", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_memory_plan_groups_are_valid(with_profile, fuse):
    qs = quantizers(["tcq-2", "tcq-3"])
    layers = tiny_layers(blocks=4)
    rng = random.Random(3)
    a = [rng.lognormvariate(-3, 1) for _ in layers]
    prof = fake_profile(qs, 1) if with_profile else None
    problem = build_problem(layers, a, qs, ERR, latency=prof, unquantized_params=0, fuse=fuse)
    budgets = parse_budgets(["2.5bits"])
    sol = solve(problem, budgets)
    plan = make_plan(problem, sol, budgets, fuse=fuse, model={}, inputs={}, options={})
    covered = []
    for blk in plan.blocks:
        for g in blk.groups:
            assert {plan.layers[n].quantizer for n in g.layers} == {g.quantizer}
            assert fuse or len(g.layers) == 1
            covered += g.layers
        if fuse and not with_profile:  # largest same-quantizer groups
            kinds = {plan.layers[n].kind: plan.layers[n].quantizer for g in blk.groups for n in g.layers}
            if kinds["gate"] == kinds["up"]:
                assert any(g.group == "gateup" for g in blk.groups)
    assert sorted(covered) == sorted(plan.layers)
    assert (plan.totals["latency_s"] is not None) == with_profile


def test_a_speed_budget_on_experts_is_refused_with_the_reason():
    """A token runs only its routed experts: a sum of per-layer latencies would count all of them."""
    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    layers = tiny_layers(**moe)
    assert any(".experts.3." in l.name for l in layers)
    qs = quantizers(["tcq-2", "tcq-3"])
    with pytest.raises(PlanError, match="mixture-of-experts.*bits or bytes budget"):
        build_problem(layers, [1.0] * len(layers), qs, ERR, latency=fake_profile(qs, 0), use_latency=True)
    build_problem(layers, [1.0] * len(layers), qs, ERR, latency=fake_profile(qs, 0))  # bits/bytes plans stay


# ---- fused blocks: a block whose norms and adds run in its GEMVs saves the profile's time ----------
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # sizes the GEMVs norm and rotate


def saving_profile(qs, seed, saving) -> LatencyProfile:
    prof = fake_profile(qs, seed)
    prof.meta["fused_block_saving_s"] = saving
    return prof


@pytest.mark.parametrize("seed", range(4))
def test_speed_plan_with_fused_block_savings_equals_brute_force(seed):
    """The brute force counts a plan's latency with the saving of each block that fuses (`usage`); the
    program's f_b variables must reach the same optimum, and the chosen plan's latency, counted by
    hand, fits the budget."""
    qs = quantizers(["tcq-2", "tcq-3", "half-tcq-2.75"])
    prof = saving_profile(qs, seed, 2.5e-5)
    layers = tiny_layers(**WIDE)
    sol = check_against_brute_force(layers, qs, ("latency",), seed, latency=prof)
    if sol is not None:
        lat = math.fsum(prof.groups[o.group][o.quantizer] for o in sol.chosen)
        assert usage(build_problem(layers, [1.0] * len(layers), qs, ERR, latency=prof, use_latency=True),
                     sol.chosen)["latency"] == pytest.approx(lat - 2.5e-5 * len(fused_by_hand(sol.chosen)))


@pytest.mark.parametrize("batch, takes", [(1, {"tcq-2.0", "nuq-4"}),
                                          (8, {"tcq-2.0", "nuq-4", "half-tcq-3.25", "nuq-8"}), (9, set())])
def test_which_entries_let_a_block_fuse_depends_on_the_batch(batch, takes, monkeypatch):
    """The runtime's rule (QuantizedLinear.takes_normed / takes_gated): at batch 1 the GEMV forms the
    block's inputs, so only entries whose GEMV can (not half-TCQ, ≤ 12 words); at batch 2–8 the
    rotation kernel forms them for any entry; above 8 rows no block fuses."""
    from qpalette.planning.program import takes_block_fusion

    monkeypatch.delenv("QPALETTE_FUSED_ROTATION", raising=False)

    for group in ("qkv", "gateup", "down"):
        got = {q for q in ("tcq-2.0", "nuq-4", "half-tcq-3.25", "nuq-8") if takes_block_fusion(group, q, 4096, batch)}
        assert got == takes, group
    assert not takes_block_fusion("o", "tcq-2.0", 4096, batch)  # o's input is the attention's output
    assert takes_block_fusion("down", "tcq-2.0", 14336, batch) == bool(takes)  # K = 28: no norm there
    assert not takes_block_fusion("qkv", "tcq-2.0", 1536, batch)  # a norm needs K = 1


@pytest.mark.parametrize("mode", ["auto", "1", "0"])
def test_the_planners_fusion_rule_is_the_runtimes(mode, monkeypatch):
    """takes_block_fusion against QuantizedLinear.takes_normed (q/k/v, gate/up) and takes_gated
    (down) on the kernels' path, over entries, input sizes, batches 1–9 and QPALETTE_FUSED_ROTATION:
    both go through ops.forms_block_input, and neither may add a condition of its own."""
    import torch
    from torch import nn

    from qpalette.planning.program import takes_block_fusion
    from qpalette.runtime import modules, ops

    monkeypatch.setenv("QPALETTE_FUSED_ROTATION", mode)
    monkeypatch.setattr(ops, "_fused_rotation_mode", lambda: {"1": "on", "0": "off"}.get(mode, "auto"))
    monkeypatch.setattr(ops, "uses_kernels", lambda x: True)
    norm = nn.RMSNorm(8).to(torch.float16)
    for q in ("tcq-2.0", "nuq-4", "half-tcq-3.25", "nuq-8"):
        for n in (64, 128, 1536, 4096, 14336):
            layer = modules.QuantizedLinear(n, 16, q)
            for batch in range(1, 10):
                x = torch.zeros(batch, n, dtype=torch.float16)
                assert takes_block_fusion("down", q, n, batch) == layer.takes_gated(x), (q, n, batch)
                for g in ("qkv", "gateup"):
                    assert takes_block_fusion(g, q, n, batch) == layer.takes_normed(x, norm), (q, n, batch)


def test_a_budget_only_fused_blocks_meet_is_met_by_fusing_them():
    """Just under the fastest plan without the saving, no plan fits; with it the plan fuses blocks
    (q/k/v and gate/up grouped, entries that form their inputs) and the document counts them."""
    qs = quantizers(["tcq-2", "half-tcq-2.75"])
    layers = tiny_layers(blocks=2, **WIDE)
    a = [1.0] * len(layers)

    def problem(saving):
        return build_problem(layers, a, qs, ERR, latency=saving_profile(qs, 1, saving), use_latency=True,
                             unquantized_params=1000)

    with pytest.raises(InfeasibleBudget) as e:
        solve(problem(0.0), [Budget("latency", 1e-9, "x")])
    budget = [Budget("latency", e.value.smallest["latency"] - 1e-6, "x")]
    with pytest.raises(InfeasibleBudget):
        solve(problem(0.0), budget)
    fused = problem(1e-4)
    sol = solve(fused, budget)
    n = len(fused_by_hand(sol.chosen))
    assert n >= 1
    plan = make_plan(fused, sol, budget, fuse=True, model={}, inputs={}, options={})
    assert plan.totals["fused_blocks"] == n
    lat = math.fsum(fused.latency.groups[o.group][o.quantizer] for o in sol.chosen)
    assert plan.totals["latency_s"] == pytest.approx(lat + fused.latency.constant_s - n * 1e-4)
    assert plan.totals["latency_s"] <= budget[0].value
