"""The kernels' sample under NVIDIA compute-sanitizer (scripts/sanitize_kernels.py): no report in
qpalette's kernels and every result right, for each tool (GPU only; minutes each); its --parts
checked without a GPU."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sanitize_kernels.py"


@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_kernels_under_compute_sanitizer(tool, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if shutil.which("compute-sanitizer") is None and not Path("/usr/local/cuda/bin/compute-sanitizer").is_file():
        pytest.skip("compute-sanitizer not found (the CUDA toolkit's bin folder)")
    res = subprocess.run([sys.executable, str(SCRIPT), "--tools", tool, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=3000)
    log = (tmp_path / f"sanitize_{tool}.log")
    tail = log.read_text()[-4000:] if log.is_file() else res.stderr[-4000:]
    assert res.returncode == 0, f"{res.stdout}\n{tail}"
    assert "0 reports in qpalette's kernels" in res.stdout


def test_an_unknown_part_of_the_sample_is_refused_by_name():
    res = subprocess.run([sys.executable, str(SCRIPT), "--parts", "attention,bogus"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert "--parts attention,bogus: choose from gemv,hadamard,attention,viterbi" in res.stderr
