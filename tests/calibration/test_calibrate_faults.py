"""Fault injection into calibrate: SIGKILL at every point of a run, then --resume gives the
coefficients of an uninterrupted run, exactly; out of GPU memory is one line and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qpalette.calibration import noise
from qpalette.calibration.sensitivity import CalibrateOptions, calibrate
from qpalette.errors import CalibrationError

DRIVER = Path(__file__).with_name("calibrate_kill_driver.py")
sys.path.insert(0, str(DRIVER.parent))
from calibrate_kill_driver import OPTIONS  # noqa: E402


def measured(doc: dict) -> dict:
    return {n: (v["a"], v["r2"], v["delta_kl"], v["shape"]) for n, v in doc["layers"].items()}


@pytest.fixture(scope="module")
def whole(tiny_llama_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("whole") / "sens.json"
    return calibrate(CalibrateOptions(model=str(tiny_llama_dir), output=out, **OPTIONS), log=lambda m: None)


@pytest.mark.parametrize("point", ["sampling", "mid_layer", "between", "final"])
def test_sigkill_then_resume_gives_the_same_coefficients(tiny_llama_dir, whole, tmp_path, point):
    out = tmp_path / "sens.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(DRIVER), str(tiny_llama_dir), str(out), point],
                         env=env, capture_output=True, text=True)
    assert res.returncode == -9, res.stderr
    assert not out.exists()
    doc = calibrate(CalibrateOptions(model=str(tiny_llama_dir), output=out, resume=True, **OPTIONS),
                    log=lambda m: None)
    assert measured(doc) == measured(whole)
    assert json.loads(out.read_text()) == doc
    assert not list(tmp_path.glob("*.partial*")) and not list(tmp_path.glob("*.lock"))


def test_a_rank_killed_under_torchrun_leaves_the_finished_rounds_and_two_devices_resume(
        tiny_llama_dir, whole, tmp_path):
    """Two processes under torchrun; rank 1 is killed in the second round: rank 0 has saved the
    first round's two layers, and a run on two devices (spawned) resumes to the coefficients of an
    uninterrupted one-device run."""
    out = tmp_path / "sens.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(DRIVER), str(tiny_llama_dir), str(out), "rank1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and not out.exists()
    partial = json.loads((tmp_path / "sens.json.partial.json").read_text())
    assert list(partial["layers"]) == list(whole["layers"])[:2]
    doc = calibrate(CalibrateOptions(model=str(tiny_llama_dir), output=out, resume=True,
                                     **{**OPTIONS, "devices": ["cpu", "cpu"]}), log=lambda m: None)
    assert doc["timing"]["resumed"] is True and doc["timing"]["placement"] == "replicas"
    assert measured(doc) == measured(whole)
    assert not list(tmp_path.glob("*.partial*"))


def test_gpu_out_of_memory_is_one_line_and_resumes(tiny_llama_dir, whole, tmp_path, monkeypatch):
    out, real, calls = tmp_path / "sens.json", noise.BlockEvaluator.mean_kl, {"n": 0}

    def oom(self):
        calls["n"] += 1
        if calls["n"] == 9:  # in the third layer
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(noise.BlockEvaluator, "mean_kl", oom)
        with pytest.raises(CalibrationError) as err:
            calibrate(CalibrateOptions(model=str(tiny_llama_dir), output=out, **OPTIONS), log=lambda m: None)
    msg = str(err.value)
    assert "\n" not in msg and "out of GPU memory after 2/15 layers" in msg and "--batch-size" in msg
    assert "--resume" in msg and not out.exists()
    doc = calibrate(CalibrateOptions(model=str(tiny_llama_dir), output=out, resume=True, **OPTIONS),
                    log=lambda m: None)
    assert measured(doc) == measured(whole)
