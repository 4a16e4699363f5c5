"""qpalette profile: the parts that need no GPU (group shapes, the refusal without CUDA)."""

import os
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


def _tiny_cfg(tiny_llama_dir, **changes) -> dict:
    cfg, _ = load_model_config(str(tiny_llama_dir))
    return {**cfg, **changes}


def test_the_anchor_model_calls_one_kernel_a_fused_group(tiny_llama_dir):
    """The quantized model whose step anchors the constant: every block's layer ANCHOR, q/k/v and
    gate/up fused (one call each), lm_head one more call when quantized."""
    from collections import Counter

    from qpalette.measure import profile

    cfg = _tiny_cfg(tiny_llama_dir, vocab_size=256, bos_token_id=255, eos_token_id=255)  # head rows: whole tiles
    calls = Counter(profile.kernel_calls(profile.anchor_model(cfg, torch.float32, lm_head=False, device="cpu")))
    assert calls == {(128, 64): 2, (64, 64): 2, (256, 64): 2, (64, 128): 2}  # qkv, o, gateup, down × 2 blocks
    head = Counter(profile.kernel_calls(profile.anchor_model(cfg, torch.float32, lm_head=True, device="cpu")))
    assert head - calls == {(256, 64): 1}
    from qpalette.runtime.modules import QuantizedLinear

    model = profile.anchor_model(cfg, torch.float32, lm_head=False, device="cpu")
    assert {m.quantizer.name for m in model.modules() if isinstance(m, QuantizedLinear)} == {profile.ANCHOR}


def test_the_measured_models_run_the_attention_loaded_models_run(tiny_llama_dir, monkeypatch):
    """The FP16 and anchor models whose steps make the constant attend like a model `load_model`
    returns (qpalette's decode attention with rope and the cache update in it), not with sdpa;
    QPALETTE_ATTENTION=sdpa keeps sdpa there as it does at load."""
    from qpalette.generation import attention
    from qpalette.measure import profile

    cfg = _tiny_cfg(tiny_llama_dir, vocab_size=256, bos_token_id=255, eos_token_id=255)
    for model in (profile.random_model(cfg, torch.float32, "cpu"),
                  profile.anchor_model(cfg, torch.float32, lm_head=True, device="cpu")):
        assert model.config._attn_implementation == attention.NAME
        assert attention.rope_attention_count(model) == cfg["num_hidden_layers"]
    monkeypatch.setenv("QPALETTE_ATTENTION", "sdpa")
    assert profile.random_model(cfg, torch.float32, "cpu").config._attn_implementation == "sdpa"


def test_the_constant_is_the_anchor_step_less_its_matmuls(tiny_llama_dir, monkeypatch):
    from qpalette.measure import profile

    def anchor_step(cfg, b, dtype, lm_head, kernels):  # 2 blocks fused, unless QPALETTE_FUSED_BLOCKS=0
        unfused = os.environ.get("QPALETTE_FUSED_BLOCKS") == "0"
        if lm_head:
            return 4.5e-3, 3.2e-3, "compiled forward loop", 2
        return (5.4e-3, 3e-3, "compiled forward loop", 0) if unfused else (5e-3, 3e-3, "compiled forward loop", 2)

    monkeypatch.delenv("QPALETTE_FUSED_BLOCKS", raising=False)
    monkeypatch.setattr(profile, "anchor_step", anchor_step)
    # as for a 4096-wide model: its blocks fuse up to 8 rows
    monkeypatch.setattr(profile, "takes_block_fusion", lambda g, q, n, batch: batch <= 8)
    monkeypatch.setattr(profile, "random_model", lambda cfg, dtype: None)
    monkeypatch.setattr(profile, "decode_step_time", lambda model, b: (7e-3, "compiled forward loop"))
    monkeypatch.setattr(profile, "fp16_linear_time", lambda cfg, b, dtype: 6e-3)
    monkeypatch.setattr(profile, "rotation_time", lambda cfg, b, dtype: 8e-4)
    monkeypatch.setattr(profile.kernel_timing, "time_fp16", lambda r, c, bs, dtype: {b: 4e-4 for b in bs})
    monkeypatch.setattr(profile.kernel_timing, "time_rotate", lambda n, bs, dtype: {b: 5e-6 for b in bs})
    monkeypatch.setattr(profile, "_release", lambda: None)
    cfg = _tiny_cfg(tiny_llama_dir, vocab_size=256, bos_token_id=255, eos_token_id=255)
    const, parts = profile.measure_constant(cfg, 1, torch.float16, say=lambda m: None)
    # the constant counts the blocks unfused: the unfused step less the matmuls, and a fused block
    # saves (5.4 − 5.0) ms / 2; the quantized-head constant adds the same 2 blocks' saving back
    assert parts["fused_blocks"] == 2 and parts["fused_block_saving_s"] == pytest.approx(2e-4)
    assert const == pytest.approx(2.4e-3) and parts["constant_quantized_head_s"] == pytest.approx(1.7e-3)
    assert parts["anchor"] == profile.ANCHOR and parts["fp16_step_s"] == 7e-3 and parts["lm_head_s"] == 4e-4
    assert "QPALETTE_FUSED_BLOCKS" not in os.environ  # restored after the unfused model
    # a vocabulary ANCHOR cannot code (257 rows): no quantized-head constant, the planner derives it
    said = []
    const, parts = profile.measure_constant(_tiny_cfg(tiny_llama_dir), 1, torch.float16, say=said.append)
    assert const == pytest.approx(2.4e-3) and "constant_quantized_head_s" not in parts
    assert any("derived" in m for m in said)
    # batch 8: the rotation kernels do the blocks' elementwise work, measured alike; batch 9: the
    # blocks keep their own forwards, nothing to subtract
    const, parts = profile.measure_constant(cfg, 8, torch.float16, say=lambda m: None)
    assert parts["fused_block_saving_s"] == pytest.approx(2e-4) and const == pytest.approx(2.4e-3)
    const, parts = profile.measure_constant(cfg, 9, torch.float16, say=lambda m: None)
    assert parts["fused_block_saving_s"] == 0 and const == pytest.approx(2e-3)
    # mixture of experts: the FP16 step less its linear layers, plus the rotations; no anchor model
    moe = _tiny_cfg(tiny_llama_dir, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    const, parts = profile.measure_constant(moe, 1, torch.float16, say=lambda m: None)
    assert const == pytest.approx(7e-3 - 6e-3 + 8e-4) and "anchor" not in parts


@pytest.mark.gpu
def test_measure_constant_on_a_gpu(tiny_llama_dir):
    from qpalette.measure import profile

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    const, parts = profile.measure_constant(_tiny_cfg(tiny_llama_dir, vocab_size=256, bos_token_id=255, eos_token_id=255),
                                            1, torch.float16,
                                            say=print)
    assert 0 < parts["anchor_linear_s"] < parts["anchor_step_s"] and const == pytest.approx(
        parts["anchor_step_s"] - parts["anchor_linear_s"] + parts["fused_block_saving_s"] * parts["fused_blocks"])
    assert parts["anchor_head_linear_s"] > parts["anchor_linear_s"]  # one more call: the head


def test_the_anchor_models_share_their_kernel_timings(tiny_llama_dir, monkeypatch):
    """The quantized-head anchor re-times only lm_head's shape; the sum counts every call."""
    from qpalette.measure import profile

    cfg = _tiny_cfg(tiny_llama_dir, vocab_size=272, bos_token_id=255, eos_token_id=255)
    real = profile.anchor_model
    monkeypatch.setattr(profile, "anchor_model", lambda c, dtype, lm_head: real(c, torch.float32, lm_head, "cpu"))
    monkeypatch.setattr(profile, "decode_step_time", lambda model, b: (1e-3, "compiled forward loop"))
    monkeypatch.setattr(profile, "_release", lambda: None)
    timed = []
    monkeypatch.setattr(profile.kernel_timing, "time_quantized",
                        lambda name, rows, cols, bs, dtype: (timed.append((rows, cols)) or {b: rows * 1e-6 for b in bs}, 0))
    kernels = {}
    _, linear, _, fused = profile.anchor_step(cfg, 1, torch.float16, False, kernels)
    assert fused == 2  # both Llama blocks run the fused forward (where the kernels take them)
    assert sorted(timed) == [(64, 64), (64, 128), (128, 64), (256, 64)]
    assert linear == pytest.approx(2 * (128 + 64 + 256 + 64) * 1e-6)  # qkv, o, gateup, down × 2 blocks
    _, linear_head, _, _ = profile.anchor_step(cfg, 1, torch.float16, True, kernels)
    assert sorted(timed[4:]) == [(272, 64)]  # the blocks' shapes are not timed again
    assert linear_head == pytest.approx(linear + 272e-6)
