"""The custom ops: registered with the reference as their CPU implementation, checked by opcheck."""

import pytest
import torch

from qpalette.quant.incoherence import pack_signs, random_signs
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes, ops


@pytest.mark.parametrize("name", ["nuq-3", "vq-2.5", "tcq-2.0", "half-tcq-2.25"])
def test_quantized_matmul_op_is_the_reference_on_cpu(name):
    gen = torch.Generator().manual_seed(3)
    rows, cols = 48, 64
    stored = get_quantizer(name).random_tensors(rows, cols, gen)
    tensors = lanes.pack(name, stored)
    x = torch.randn(2, 3, cols, generator=gen)
    y = ops.quantized_matmul(x, name, tensors, (rows, cols))
    assert y.shape == (2, 3, rows)
    assert torch.equal(y, ops.quantized_matmul_reference(x, name, tensors, (rows, cols)))
    want = (x @ ops.dequantize(name, stored, (rows, cols)).T)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    codes, codes_b = ops.code_tensors(name, tensors)
    torch.library.opcheck(torch.ops.qpalette.quantized_matmul,
                          (x, codes, codes_b, tensors["row_scale"], get_quantizer(name).name, rows))


@pytest.mark.parametrize("n", [64, 576])
def test_rotate_op_is_the_reference_on_cpu(n):
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    signs = pack_signs(random_signs(n, seed=1))
    assert torch.equal(ops.rotate(x, signs), ops.rotate_reference(x, signs))
    torch.library.opcheck(torch.ops.qpalette.rotate, (x, signs))


@pytest.mark.parametrize("name", ["tcq-2.0", "half-tcq-2.25", "nuq-4"])
def test_rotated_matmul_is_rotate_then_matmul(name):
    rows, cols = 32, 256
    tensors = lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, torch.Generator().manual_seed(5)))
    signs = pack_signs(random_signs(cols, seed=2))
    x = torch.randn(2, 3, cols, generator=torch.Generator().manual_seed(6))
    y = ops.rotated_matmul(x, signs, name, tensors, (rows, cols))
    assert torch.equal(y, ops.quantized_matmul(ops.rotate(x, signs), name, tensors, (rows, cols)))
    codes, codes_b = ops.code_tensors(name, tensors)
    torch.library.opcheck(torch.ops.qpalette.rotated_matmul,
                          (x, signs, codes, codes_b, tensors["row_scale"], get_quantizer(name).name, rows))


@pytest.mark.parametrize("name", ["tcq-2.0", "nuq-4"])
def test_gated_rotated_matmul_is_silu_gate_times_up_then_rotated_matmul(name):
    rows, cols = 32, 256
    tensors = lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, torch.Generator().manual_seed(5)))
    signs = pack_signs(random_signs(cols, seed=2))
    gu = torch.randn(2, 3, 2 * cols, generator=torch.Generator().manual_seed(7))
    gate, up = gu[..., :cols], gu[..., cols:]
    y = ops.gated_rotated_matmul(gu, signs, name, tensors, (rows, cols))
    expect = ops.rotated_matmul(gate * torch.sigmoid(gate) * up, signs, name, tensors, (rows, cols))
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    codes, codes_b = ops.code_tensors(name, tensors)
    torch.library.opcheck(torch.ops.qpalette.gated_rotated_matmul,
                          (gu, signs, codes, codes_b, tensors["row_scale"], get_quantizer(name).name, rows))


@pytest.mark.parametrize("name", ["tcq-2.0", "nuq-4"])
def test_gated_rotated_matmul_adds_the_residual_to_its_output(name):
    rows, cols = 32, 256
    tensors = lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, torch.Generator().manual_seed(5)))
    signs = pack_signs(random_signs(cols, seed=2))
    gen = torch.Generator().manual_seed(8)
    gu, res = torch.randn(2, 3, 2 * cols, generator=gen), torch.randn(2, 3, rows, generator=gen)
    y = ops.gated_rotated_matmul(gu, signs, name, tensors, (rows, cols), residual=res)
    assert torch.equal(y, ops.gated_rotated_matmul(gu, signs, name, tensors, (rows, cols)) + res)
    codes, codes_b = ops.code_tensors(name, tensors)
    torch.library.opcheck(torch.ops.qpalette.gated_rotated_matmul,
                          (gu, signs, codes, codes_b, tensors["row_scale"], get_quantizer(name).name, rows, res))


def test_rms_norm_reference_is_llamas():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5)
    h = (torch.randn(4, 96, generator=torch.Generator().manual_seed(2)) * 30).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm_reference(h, norm.weight, norm.variance_epsilon), norm(h))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("name", ["tcq-2.0", "half-tcq-2.25"])
def test_normed_rotated_matmul_is_add_norm_then_rotated_matmul(name, with_residual):
    rows, cols = 32, 256
    tensors = lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, torch.Generator().manual_seed(5)))
    signs = pack_signs(random_signs(cols, seed=2))
    gen = torch.Generator().manual_seed(9)
    x, res = torch.randn(2, 3, cols, generator=gen), torch.randn(2, 3, cols, generator=gen)
    weight, eps = torch.rand(cols, generator=gen) + 0.5, 1e-6
    residual = res if with_residual else None
    y, h = ops.normed_rotated_matmul(x, weight, eps, signs, name, tensors, (rows, cols), residual=residual)
    want_h = x + res if with_residual else x
    want = ops.rotated_matmul(ops.rms_norm_reference(want_h, weight, eps), signs, name, tensors, (rows, cols))
    assert torch.equal(y, want)
    assert (h is None) != with_residual and (h is None or torch.equal(h, want_h))
    codes, codes_b = ops.code_tensors(name, tensors)
    torch.library.opcheck(torch.ops.qpalette.normed_rotated_matmul,
                          (x, residual, weight, eps, signs, codes, codes_b, tensors["row_scale"],
                           get_quantizer(name).name, rows))


def test_input_sizes_whose_gemv_applies_a_norm():
    """One CTA holds the whole row: powers of two the GEMV rotates (K = 1) only."""
    assert all(ops.gemv_norms(n) for n in (128, 512, 4096))
    assert not any(ops.gemv_norms(n) for n in (64, 576, 1536, 8192, 14336))


def test_entries_whose_gemv_forms_the_gated_input():
    """Mirrors Pair::FORMS_INPUT: not half-TCQ, ≤ 12 code words a lane and group (≤ 6 bits)."""
    assert all(ops.gemv_forms_input(n) for n in ("tcq-2.0", "tcq-5.0", "nuq-4", "nuq-6", "vq-6.0"))
    assert not any(ops.gemv_forms_input(n) for n in ("nuq-7", "nuq-8", "half-tcq-2.25", "half-tcq-3.25"))


def test_fused_rotation_sizes_and_modes(monkeypatch):
    monkeypatch.delenv("QPALETTE_FUSED_ROTATION", raising=False)
    assert ops.fuses_rotation(4096, 1) and not ops.fuses_rotation(4096, 2)  # auto: batch 1 only
    monkeypatch.setenv("QPALETTE_FUSED_ROTATION", "1")
    assert ops.fuses_rotation(4096, 8) and ops.fuses_rotation(128, 1) and not ops.fuses_rotation(8192, 1)
    assert ops.fuses_rotation(14336, 1) and ops.fuses_rotation(1536, 1)  # K·2^m: 28·512, 12·128
    assert not ops.fuses_rotation(576, 1) and not ops.fuses_rotation(64, 1) and not ops.fuses_rotation(11008, 1)
    monkeypatch.setenv("QPALETTE_FUSED_ROTATION", "0")
    assert not ops.fuses_rotation(4096, 1)
