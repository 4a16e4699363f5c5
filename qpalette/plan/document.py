"""Plans as JSON (`qpalette.plan/1`), their readable tables, and the bits-per-layer plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from qpalette.errors import InputError
from qpalette.fileio import atomic_write, read_json_object
from qpalette.models.topology import GROUPS
from qpalette.plan.budget import Budget
from qpalette.plan.program import Problem, Solution, choose_groups, gap_decomposition, usage

PLAN_FORMAT = "qpalette.plan/1"


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
) -> dict:
    layers = problem.layers
    qs = problem.quantizers
    assignment: dict[int, str] = {}
    group_of: dict[int, str] = {}
    for o in solution.chosen:
        for i in o.layers:
            assignment[i] = o.quantizer
            group_of[i] = o.group
    if problem.fused or not fuse:
        triples = [(o.block, o.group, o.quantizer) for o in solution.chosen]
    else:
        triples = choose_groups(problem, assignment, fuse)
    by_block_kind = {(l.block, l.kind): i for i, l in enumerate(layers)}
    prof = problem.latency
    blocks: dict[int, dict] = {}
    for b, g, q in triples:
        lat = prof.groups.get(g, {}).get(q) if prof else None
        names = [layers[by_block_kind[(b, k)]].name for k in GROUPS[g]]
        for k in GROUPS[g]:
            group_of[by_block_kind[(b, k)]] = g
        blk = blocks.setdefault(b, {"block": b, "groups": []})
        blk["groups"].append({"group": g, "quantizer": q, "layers": names, "latency_s": lat})
    for blk in blocks.values():
        lats = [g["latency_s"] for g in blk["groups"]]
        blk["latency_s"] = None if any(t is None for t in lats) else math.fsum(lats)

    n = [l.numel for l in layers]
    bits = [qs[assignment[i]].bits for i in range(len(layers))]
    err = [problem.err[assignment[i]] for i in range(len(layers))]
    gaps = gap_decomposition(problem.a, n, bits, err)
    ideal_bits = gaps.pop("ideal_bits")

    per_layer = {}
    for i, l in enumerate(layers):
        q = qs[assignment[i]]
        per_layer[l.name] = {
            "quantizer": q.name,
            "family": q.family,
            "bits": q.bits,
            "shape": [l.out_features, l.in_features],
            "block": l.block,
            "kind": l.kind,
            "group": group_of[i],
            "bytes": q.stored_bytes(l.out_features, l.in_features),
            "a": problem.a[i],
            "err": err[i],
            "loss": problem.a[i] * err[i],
            "ideal_bits": ideal_bits[i],
        }
    books = sorted({c for i in assignment for c in qs[assignment[i]].codebooks})
    use = usage(problem, solution.chosen)
    codes = sum(v["bytes"] for v in per_layer.values())
    cb = sum(problem.codebook_bytes[c] for c in books)
    total_bytes = None
    if problem.unquantized_bytes is not None:
        total_bytes = codes + cb + problem.sign_bytes + problem.unquantized_bytes
    block_lats = [blk["latency_s"] for blk in blocks.values()]
    notes = list(notes or [])
    if prof is not None:
        untimed = sorted({f"{g}/{q}" for b, g, q in triples if prof.groups.get(g, {}).get(q) is None})
        if untimed:
            notes.append(
                f"no predicted latency: the latency profile has no time for {', '.join(untimed[:8])}"
                + (" …" if len(untimed) > 8 else "")
            )
    latency = None
    if prof is not None and all(t is not None for t in block_lats):
        latency = math.fsum(block_lats) + prof.constant_s
    totals = {
        "predicted_loss": math.fsum(v["loss"] for v in per_layer.values()),
        "avg_bits": use["bits"] / (4 * problem.total_params),
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
        "tok_per_s": None if latency is None else 1.0 / latency,
        "batch_size": prof.batch_size if prof else None,
        "throughput_tok_per_s": None if latency is None else prof.batch_size / latency,
    }
    return {
        "format": PLAN_FORMAT,
        "model": model,
        "budgets": [b.to_json() for b in budgets],
        "options": options,
        "totals": totals,
        "bound": gaps,
        "solver": {
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
        },
        "codebooks": books,
        "layers": per_layer,
        "blocks": [blocks[b] for b in sorted(blocks)],
        "provenance": inputs,
        "notes": list(problem.notes) + notes,
    }


def write_plan(plan: dict, path: str | Path) -> None:
    atomic_write(path, json.dumps(plan, indent=1) + "\n")


def load_plan(path: str | Path) -> dict:
    return read_json_object(path, "plan", InputError, PLAN_FORMAT, "written by `qpalette plan`")


# -- text ---------------------------------------------------------------------------------------
def _bytes(v) -> str:
    if v is None:
        return "unknown"
    return f"{v:,} B ({v / 1e9:.4f} GB)"


def summary(plan: dict) -> str:
    t, s, g = plan["totals"], plan["solver"], plan["bound"]
    by = t["bytes"]
    lines = [
        f"plan for {plan['model'].get('name') or plan['model'].get('source')}: "
        f"{len(plan['layers'])} linear layers in {len(plan['blocks'])} blocks",
        "budgets: " + ", ".join(b["text"] for b in plan["budgets"]),
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
            f"(batch {t['batch_size']})"
        )
    else:
        given = (plan.get("provenance") or {}).get("latency_profile")
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
    for n in plan.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def block_table(plan: dict) -> str:
    """One line per block: each layer's quantizer and the fusion groups."""
    kinds = ("q", "k", "v", "o", "gate", "up", "down")
    rows = {}
    for name, v in plan["layers"].items():
        rows.setdefault(v["block"], {})[v["kind"]] = v["quantizer"]
    head = f"{'blk':>3} " + " ".join(f"{k:>13}" for k in kinds) + "  groups"
    out = [head]
    for blk in plan["blocks"]:
        b = blk["block"]
        groups = " ".join(g["group"] for g in blk["groups"] if len(GROUPS[g["group"]]) > 1)
        out.append(f"{b:>3} " + " ".join(f"{rows[b].get(k, '-'):>13}" for k in kinds)
                   + f"  {groups or '-'}")
    return "\n".join(out)


def layer_table(plan: dict) -> str:
    lines = [f"{'layer':<36} {'shape':>11} {'quantizer':>13} {'group':>6} {'bits':>5} "
             f"{'ideal b*':>8} {'a_l':>10} {'err':>9} {'loss':>10} {'bytes':>11}"]
    for name, v in plan["layers"].items():
        shape = f"{v['shape'][0]}×{v['shape'][1]}"
        lines.append(
            f"{name:<36} {shape:>11} {v['quantizer']:>13} {v['group']:>6} {v['bits']:5.2f} "
            f"{v['ideal_bits']:8.3f} {v['a']:10.4g} {v['err']:9.3g} {v['loss']:10.4g} {v['bytes']:>11,}"
        )
    return "\n".join(lines)


# -- plot ---------------------------------------------------------------------------------------
_COLORS = {"nuq": "tab:green", "vq": "tab:orange", "tcq": "tab:blue", "half-tcq": "tab:purple"}


def plot_plan(plan: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(plan["layers"])
    v = [plan["layers"][n] for n in names]
    fig, ax = plt.subplots(figsize=(max(8, min(40, len(names) * 0.06)), 4))
    xs = range(len(names))
    ax.bar(xs, [r["bits"] for r in v], width=1.0, color=[_COLORS.get(r["family"], "gray") for r in v])
    ax.plot(xs, [r["ideal_bits"] for r in v], color="black", lw=0.8, label="ideal b* (theorem)")
    for fam, c in _COLORS.items():
        if any(r["family"] == fam for r in v):
            ax.bar([0], [0], color=c, label=fam)
    t = plan["totals"]
    title = f"{plan['model'].get('name') or ''}  budgets {', '.join(b['text'] for b in plan['budgets'])}: " \
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
