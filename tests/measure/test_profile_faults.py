"""Fault injection into `qpalette profile` (fake timings, no GPU): SIGKILL at every point of a run,
then --resume writes the profiles of an uninterrupted run (all but the wall time); a leftover
run is not overwritten without --resume, nor resumed with other settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qpalette.errors import InputError
from qpalette.measure import profile

DRIVER = Path(__file__).with_name("profile_kill_driver.py")
sys.path.insert(0, str(DRIVER.parent))
from profile_kill_driver import ENTRIES, fake_gpu, run  # noqa: E402

POINTS = ["constant", "mid_shape", "between", "final"]


def docs(paths) -> list[dict]:
    """The written profiles without their wall time (the one field a second session changes)."""
    out = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        d["measured"].pop("seconds")
        out.append(d)
    return out


@pytest.fixture
def gpu(monkeypatch):
    fake_gpu(monkeypatch.setattr)


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_then_resume_gives_the_same_profiles(tiny_llama_dir, tmp_path, gpu, point):
    whole = docs(run(str(tiny_llama_dir), tmp_path / "whole"))
    out = tmp_path / "killed"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(DRIVER), str(tiny_llama_dir), str(out), point],
                         env=env, capture_output=True, text=True)
    assert res.returncode == -9, res.stderr
    partial = out / "latency_tiny_b1-8.partial.json"
    assert partial.is_file() == (point != "constant")  # killed before anything was measured: nothing saved
    if partial.is_file():
        with pytest.raises(InputError, match="--resume"):
            run(str(tiny_llama_dir), out)
    assert docs(run(str(tiny_llama_dir), out, resume=True)) == whole
    assert sorted(p.name for p in out.iterdir()) == ["latency_tiny_b1.json", "latency_tiny_b8.json"]


def test_resume_with_other_settings_is_refused(tiny_llama_dir, tmp_path, gpu, monkeypatch):
    real, timed = profile.kernel_timing.time_quantized, []

    def interrupted_in_the_second_shape(*args):
        timed.append(args)
        if len(timed) > len(ENTRIES):
            raise KeyboardInterrupt
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(profile.kernel_timing, "time_quantized", interrupted_in_the_second_shape)
        with pytest.raises(KeyboardInterrupt):
            run(str(tiny_llama_dir), tmp_path)
    with pytest.raises(InputError, match="other settings"):
        profile.run_profile(str(tiny_llama_dir), [1, 8], tmp_path, ENTRIES[:1], name="tiny", resume=True,
                            say=lambda m: None)
