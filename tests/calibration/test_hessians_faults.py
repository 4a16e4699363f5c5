"""Fault injection into `qpalette hessians`: SIGKILL at every point of a run, then --resume writes
files byte-identical to an uninterrupted run's, and the same manifest entries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qpalette.calibration.hessians import MANIFEST, HessianOptions, collect_hessians

DRIVER = Path(__file__).with_name("hessians_kill_driver.py")
sys.path.insert(0, str(DRIVER.parent))
from hessians_kill_driver import OPTIONS  # noqa: E402

POINTS = ["first_block", "mid_file", "between", "final"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("the weights of every layer round to codes on this calibration text " * 30)
    return path


def collect(model, text, out, **kw) -> dict:
    opts = HessianOptions(model=str(model), output=out, text_file=str(text), **OPTIONS, **kw)
    return collect_hessians(opts, log=lambda m: None)


@pytest.fixture(scope="module")
def whole(tiny_llama_dir, text_file, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("whole") / "h"
    return out, collect(tiny_llama_dir, text_file, out)


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_then_resume_gives_identical_files(tiny_llama_dir, text_file, whole, tmp_path, point):
    out = tmp_path / "h"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(DRIVER), str(tiny_llama_dir), str(text_file), str(out), point],
                         env=env, capture_output=True, text=True)
    assert res.returncode == -9, res.stderr
    assert not (out / MANIFEST).exists()
    manifest = collect(tiny_llama_dir, text_file, out, resume=True)
    ref_dir, ref = whole
    assert manifest["files"] == ref["files"]
    names = sorted(p.name for p in ref_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names  # no stray temporaries
    assert not (tmp_path / "h.lock").exists()
    for name in names:
        if name != MANIFEST:
            assert (out / name).read_bytes() == (ref_dir / name).read_bytes(), name
