"""scripts/profile_gemv.py without a GPU: one call a shape (the reference), the NVTX range names
ncu filters on, and clear errors for bad arguments."""

from __future__ import annotations

import pytest
from helpers import load_script


def test_dry_run_names_one_range_a_shape(capsys):
    script = load_script("profile_gemv")
    assert script.main(["--entry", "half-tcq-3.25", "--shapes", "32x256,64x512", "--batch", "3", "--rotate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == ["half-tcq-3.25 32x256 batch 3 rotated", "half-tcq-3.25 64x512 batch 3 rotated"]


@pytest.mark.parametrize("args, message", [
    (["--entry", "tcq-9.0"], "unknown quantizer"),
    (["--shapes", "10x20"], "multiples of 16"),
    (["--shapes", ","], "at least one"),
    (["--batch", "9"], "1–8 rows"),
])
def test_bad_arguments_exit_2_with_a_message(args, message, capsys):
    assert load_script("profile_gemv").main(args) == 2
    assert message in capsys.readouterr().err
