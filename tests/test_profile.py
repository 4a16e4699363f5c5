"""qpalette profile: the parts that need no GPU (group shapes, the refusal without CUDA)."""

from pathlib import Path

import pytest
import torch

from qpalette.plan_inputs import GROUPS
from qpalette.profile_command import group_shapes, load_model_config, run_profile

LLAMA = Path(__file__).resolve().parents[1] / "profiles" / "reference" / "llama31_8b" / "config.json"


def test_group_shapes_llama31_8b():
    cfg, _ = load_model_config(str(LLAMA))
    shapes = group_shapes(cfg)
    assert set(shapes) == set(GROUPS)
    assert shapes["qkv"] == (6144, 4096) and shapes["gateup"] == (28672, 4096)
    assert shapes["down"] == (4096, 14336) and shapes["kv"] == (2048, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_profile_needs_cuda(tmp_path):
    with pytest.raises(RuntimeError, match="CUDA"):
        run_profile(str(LLAMA), [1], tmp_path)
