"""qpalette profile: the parts that need no GPU (group shapes, the refusal without CUDA)."""

from pathlib import Path

import pytest
import torch

from qpalette.errors import KernelError
from qpalette.measure.profile import group_shapes, load_model_config, run_profile
from qpalette.models.topology import GROUPS

LLAMA = Path(__file__).resolve().parents[2] / "profiles" / "reference" / "llama31_8b" / "config.json"


def test_group_shapes_llama31_8b():
    cfg, _ = load_model_config(str(LLAMA))
    shapes = group_shapes(cfg)
    assert set(shapes) == set(GROUPS)
    assert shapes["qkv"] == (6144, 4096) and shapes["gateup"] == (28672, 4096)
    assert shapes["down"] == (4096, 14336) and shapes["kv"] == (2048, 4096)
    assert shapes["head"] == (128256, 4096)  # lm_head, for plans that quantize it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_profile_needs_cuda(tmp_path):
    with pytest.raises(KernelError, match="CUDA"):
        run_profile(str(LLAMA), [1], tmp_path)


def test_profile_cli_without_gpu_is_a_message(tiny_llama_dir):
    import torch
    from typer.testing import CliRunner

    from qpalette.cli import app

    if torch.cuda.is_available():
        import pytest

        pytest.skip("has a GPU")
    res = CliRunner().invoke(app, ["profile", str(tiny_llama_dir), "--batch-sizes", "1"])
    assert res.exit_code == 2 and "no CUDA device" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["profile", str(tiny_llama_dir), "--palette", "tcq-9"])
    assert res.exit_code == 2 and "unknown quantizer" in res.output
