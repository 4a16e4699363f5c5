"""scripts/bench_kernels.py without a GPU: shape arguments and the regression gates."""

from __future__ import annotations

import pytest
from helpers import load_script


def test_llama_shapes_keep_their_label_however_named():
    script = load_script("bench_kernels")
    shapes = script.parse_shapes("14336x4096, 96X128")
    assert shapes == {"gate/up 14336x4096": (14336, 4096), "96x128": (96, 128)}
    assert script.parse_shapes("all") == script.SHAPES


@pytest.mark.parametrize("spec", ["4096*4096", "4096x", "x"])
def test_a_bad_shape_says_what_is_expected(spec):
    with pytest.raises(SystemExit, match="expected OUTxIN"):
        load_script("bench_kernels").parse_shapes(spec)


def test_targets_gate_rows_of_a_run_that_named_shapes_by_size():
    """A run of `--shapes 4096x4096` (label "4096x4096", as results/kernels_h100/v6 was) is held to
    q/o 4096x4096's targets."""
    script = load_script("bench_kernels")
    rows = [{"shape": "4096x4096", "rows": 4096, "cols": 4096, "entry": "tcq-2.0", "batch": m, "us": us}
            for m, us in ((1, 5.75), (8, 6.32))]
    by_what = {g["what"]: g for g in script.gates(rows, [1, 8])}
    assert by_what["4096x4096 tcq-2.0 b1 µs"]["limit"] == 4.5 and not by_what["4096x4096 tcq-2.0 b1 µs"]["met"]
    assert by_what["4096x4096 tcq-2.0 b8/b1"]["met"]


@pytest.mark.parametrize("device, said", [("NVIDIA H100 80GB HBM3", False), ("NVIDIA H200", True)])
def test_the_report_says_when_the_us_targets_belong_to_another_gpu(device, said):
    script = load_script("bench_kernels")
    rows = [{"shape": "q/o 4096x4096", "rows": 4096, "cols": 4096, "entry": "tcq-2.0", "batch": m, "us": us,
             "roofline_fraction": 0.2} for m, us in ((1, 5.75), (8, 6.32))]
    meta = {"device": device, "dtype": "float16", "copy_bandwidth_Bps": 4.1e12, "rotate_us": {},
            "gates": script.gates(rows, [1, 8])}
    assert ("issue 14's H100 targets" in script.render(rows, [1, 8], meta)) == said


def test_block_shapes_are_also_timed_as_the_fused_block_calls_them():
    script = load_script("bench_kernels")
    shapes = script.parse_shapes("all")
    ways = {label: script.rotation_ways(label, cols) for label, (_, cols) in shapes.items()}
    assert ways["down 4096x14336"]["fused + silu(gate)·up + residual"] == (True, "gated")
    assert ways["gateup 28672x4096"]["fused + add + RMSNorm"] == (True, "add_norm")
    assert ways["qkv 6144x4096"]["fused + RMSNorm"] == (True, "norm")
    assert ways["q/o 4096x4096"] == {"separate": (False, "rotate"), "fused": (True, "rotate")}  # o: rotation only
    assert script.rotation_ways("96x576", 576) == {"separate": (False, "rotate")}  # 576: no fused rotation
