"""Helpers shared by several test modules (tests never import one another)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from qpalette.compression.writer import CompressOptions, compress


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package), to call its functions and main."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_compress(src, out, **kw) -> dict:
    return compress(CompressOptions(model=str(src), output=Path(out), quiet=True, **kw), log=lambda m: None)


class Killed(BaseException):
    """What a kill looks like to the run: it stops where it is."""


def compress_killed_at_second_shard(src, out, monkeypatch, **kw) -> None:
    """run_compress(src, out, **kw) stopped as if killed while writing its second shard."""
    import pytest

    from qpalette.compression import writer

    real, calls = writer.shard_tensors, []

    def killed_at_second_shard(*args):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(writer, "shard_tensors", killed_at_second_shard)
        with pytest.raises(Killed):
            run_compress(src, out, **kw)


def fake_sensitivity(model_dir, path):
    from qpalette.models.topology import linear_layers, load_config

    layers = linear_layers(load_config(model_dir))
    g = torch.Generator().manual_seed(1)
    doc = {"format": "qpalette.sensitivity/1", "model": str(model_dir), "protocol": "test",
           "tokens": None, "layers": {
               l.name: {"a": float(torch.rand(1, generator=g)) + 0.1, "r2": None,
                        "shape": [l.out_features, l.in_features]} for l in layers}}
    path.write_text(json.dumps(doc))
    return path


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    import math

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else 0.0


def block_covers(problem) -> list[list[list]]:
    """Per block (in block order), every way to cover its layers exactly once by its options."""
    by_block: dict[int, list] = {}
    for o in problem.options:
        by_block.setdefault(o.block, []).append(o)
    covers = []
    for _, opts in sorted(by_block.items()):
        found: list[list] = []

        def extend(picked: list, left: set[int]) -> None:
            if not left:
                found.append(list(picked))
                return
            first = min(left)
            for o in opts:
                if first in o.layers and set(o.layers) <= left:
                    extend(picked + [o], left - set(o.layers))

        extend([], {i for o in opts for i in o.layers})
        covers.append(found)
    return covers


def exhaustive(problem, budgets) -> tuple[float, list] | None:
    """Brute-force optimum of a planning problem (tiny instances): (loss, chosen options) over
    every per-block cover that fits the budgets, or None if none fits."""
    import math
    from itertools import product

    from qpalette.planning.program import _caps, usage

    caps = _caps(problem, budgets)
    best = None
    for combo in product(*block_covers(problem)):
        chosen = [o for c in combo for o in c]
        use = usage(problem, chosen)
        if any(use[r] > caps[r] + (1e-15 if r == "latency" else 0) for r in caps):
            continue
        loss = math.fsum(o.loss for o in chosen)
        if best is None or loss < best[0] - 1e-15:
            best = (loss, chosen)
    return best
