"""scripts/bench_pipeline.py: the calibration projection, and the whole script on the tiny model
(CPU, no nvidia-smi: no GPU memory is reported)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import load_script


def _script():
    return load_script("bench_pipeline")


def test_projection_is_the_sum_of_the_fitted_line():
    """Layers of a 2-block model taking 1 + 2·(blocks run) s: 32 blocks of 3 layers and the head."""
    layers = {f"model.layers.{b}.mlp.l{k}": {"seconds": 1 + 2 * (2 - b)} for b in range(2) for k in range(3)}
    layers["lm_head"] = {"seconds": 1.0}
    p = _script().project_calibration({"layers": layers}, blocks=2, project_blocks=32, layers_per_block=3,
                                      seqs_factor=2.0)
    assert p["fit_s_per_layer"] == {"constant": pytest.approx(1.0), "per_block_run": pytest.approx(2.0)}
    expected = (sum(1 + 2 * (32 - b) for b in range(32)) * 3 + 1) * 2
    assert p["projected_layers_s"] == pytest.approx(expected, abs=0.1)


def test_runs_the_three_steps(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py"])
    rc = _script().main([str(tiny_llama_dir), "--work", str(tmp_path / "w"), "--devices", "cpu", "--num-seqs", "2",
                         "--budget", "3.0bits", "--project-blocks", "4", "--levels", "3", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and set(doc["steps"]) == {"calibrate", "plan", "compress"}
    assert doc["steps"]["calibrate"]["projection"]["projected_blocks"] == 4
    assert "--levels 3" in doc["steps"]["calibrate"]["command"]
    assert json.loads((tmp_path / "w" / "sens.json").read_text())["levels"] == 3
    assert doc["steps"]["compress"]["report"]["avg_bits"] <= 3.0 + 1e-9
    assert all(s["wall_s"] > 0 for s in doc["steps"].values())
