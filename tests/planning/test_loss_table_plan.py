"""`plan --loss-table`: the measured losses replace a_l·err(q); checked against brute force."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from qpalette.cli import app
from qpalette.errors import InputError
from qpalette.models.topology import linear_layers, load_config
from qpalette.planning.planner import plan

PALETTE = ["nuq-2", "nuq-4"]
BITS = {"nuq-2": 2, "nuq-4": 4}


def _table(model_dir, path, edit=lambda rows: None):
    layers = linear_layers(load_config(model_dir))
    g = torch.Generator().manual_seed(3)
    rows = {}
    for l in layers:
        lo, hi = sorted(float(x) for x in torch.rand(2, generator=g))
        rows[l.name] = {"nuq-2": hi, "nuq-4": lo * 0.3 - 0.01, "vq-3.0": lo}
    edit(rows)
    doc = {"format": "qpalette.loss_table/1", "model": str(model_dir), "entries": ["nuq-2", "nuq-4", "vq-3.0"],
           "shapes": {l.name: [l.out_features, l.in_features] for l in layers}, "rows": rows}
    path.write_text(json.dumps(doc))
    return path, layers, rows


def _brute_force(layers, rows, avg_bits):
    """Minimum Σ table[l][q_l] over every assignment (entries of PALETTE the row has) within the budget."""
    n = [l.out_features * l.in_features for l in layers]
    choices = [[q for q in PALETTE if q in rows[l.name]] for l in layers]
    best = math.inf
    for combo in itertools.product(*choices):
        if sum(BITS[q] * k for q, k in zip(combo, n)) <= avg_bits * sum(n):
            best = min(best, math.fsum(rows[l.name][q] for l, q in zip(layers, combo)))
    return best


@pytest.mark.parametrize("budget", [2.5, 3.0, 3.6])
def test_plan_minimises_the_tables_sum(tiny_llama_dir, tmp_path, budget):
    # one layer lacks nuq-4 in the table: it can only take nuq-2
    path, layers, rows = _table(tiny_llama_dir, tmp_path / "t.json",
                                lambda r: r["model.layers.1.mlp.up_proj"].pop("nuq-4"))
    p = plan(str(tiny_llama_dir), [f"{budget}bits"], sensitivity=None, loss_table=str(path), palette=PALETTE)
    chosen = {n: v.quantizer for n, v in p.layers.items()}
    assert chosen["model.layers.1.mlp.up_proj"] == "nuq-2"
    total = math.fsum(rows[n][q] for n, q in chosen.items())
    assert p.totals["predicted_loss"] == pytest.approx(total, abs=1e-12)
    assert total == pytest.approx(_brute_force(layers, rows, budget), abs=1e-9)
    assert p.provenance["loss_table"]["path"] == str(path) and len(p.provenance["loss_table"]["sha256"]) == 64
    assert p.provenance["sensitivity"] is None
    assert any("nuq-4: 1 layers" in n for n in p.notes)


def test_table_with_sensitivity_keeps_its_coefficients(tiny_llama_dir, tmp_path):
    from helpers import fake_sensitivity

    path, _layers, rows = _table(tiny_llama_dir, tmp_path / "t.json")
    sens = fake_sensitivity(tiny_llama_dir, tmp_path / "s.json")
    p = plan(str(tiny_llama_dir), ["3bits"], sensitivity=str(sens), loss_table=str(path), palette=PALETTE)
    a = {n: v["a"] for n, v in json.loads(sens.read_text())["layers"].items()}
    assert all(v.a == pytest.approx(a[n]) for n, v in p.layers.items())
    assert all(v.loss == rows[n][v.quantizer] for n, v in p.layers.items())
    without = plan(str(tiny_llama_dir), ["3bits"], sensitivity=str(sens), palette=PALETTE)
    assert without.provenance.get("loss_table") is None  # plan without the option: as before


def test_table_of_another_model_is_refused(tiny_llama_dir, tmp_path):
    path, _l, _r = _table(tiny_llama_dir, tmp_path / "t.json",
                          lambda r: r.update({"model.layers.7.mlp.up_proj": {"nuq-2": 1.0}}))
    r = CliRunner().invoke(app, ["plan", str(tiny_llama_dir), "-b", "3bits", "--loss-table", str(path),
                                 "-o", str(tmp_path / "p.json"), "--no-plot"])
    assert r.exit_code == 2, r.output
    assert "does not match the model" in r.output and "model.layers.7.mlp.up_proj" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    path, _l, _r = _table(tiny_llama_dir, tmp_path / "u.json", lambda r: r.pop("model.layers.0.self_attn.q_proj"))
    with pytest.raises(InputError, match="have no row"):
        plan(str(tiny_llama_dir), ["3bits"], sensitivity=None, loss_table=str(path))
    path.write_text(json.dumps({"format": "qpalette.loss_table/1", "rows": {"x": {"tcq-9": 1}}}))
    with pytest.raises(InputError, match="unknown quantizer"):
        plan(str(tiny_llama_dir), ["3bits"], sensitivity=None, loss_table=str(path))


def test_cli_plan_with_a_loss_table(tiny_llama_dir, tmp_path):
    path, _l, _r = _table(tiny_llama_dir, tmp_path / "t.json")
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["plan", str(tiny_llama_dir), "-b", "3bits", "--loss-table", str(path),
                                 "-p", "nuq-2,nuq-4", "-o", str(out), "--no-plot"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["provenance"]["loss_table"]["path"] == str(path)
