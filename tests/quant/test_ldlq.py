"""Block LDLQ: the factorisation, lower proxy loss than nearest rounding for every family, the
data-free codes when H carries no correlation, the rotated Hessian."""

from __future__ import annotations

import pytest
import torch

from qpalette.errors import InputError
from qpalette.quant.incoherence import random_signs, rotate_hessian, rotate_weight
from qpalette.quant.ldlq import block_ldl, ldl_feedback, ldlq, ldlq_many, proxy_loss
from qpalette.quant.palette import get_quantizer

# one small entry of each family; trellis shapes stay at 2×4 tiles (Viterbi is slow on a CPU)
ENTRIES = {"nuq-3": (64, 64), "vq-2.0": (64, 64), "tcq-2.0": (32, 64), "half-tcq-2.25": (32, 64)}


def spd(n: int, seed: int) -> torch.Tensor:
    """A random symmetric positive definite H = Q Λ Qᵀ with a spectrum decaying over four decades."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return ((q * torch.logspace(0, -4, n, dtype=torch.float64)) @ q.T).float()


def weights(shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("block", [1, 2, 16])
def test_block_ldl_factors_h(block):
    h = spd(64, 0).double()
    a = block_ldl(h, block)
    n = torch.arange(64) // block
    same_block = n[:, None] == n[None, :]
    assert torch.equal(a.diagonal(), torch.ones(64, dtype=a.dtype))
    assert a[n[:, None] > n[None, :]].abs().max() == 0  # unit upper block-triangular
    assert torch.allclose(a[same_block], torch.eye(64, dtype=a.dtype)[same_block])
    inv = torch.linalg.inv(a)
    d = inv @ h @ inv.T  # block diagonal: H = A D Aᵀ
    assert d[~same_block].abs().max() < 1e-10 * d.abs().max()


@pytest.mark.parametrize("name", ENTRIES)
def test_ldlq_lowers_the_proxy_loss(name):
    q, shape = get_quantizer(name), ENTRIES[name]
    w, h = weights(shape), spd(shape[1], 2)
    nearest = q.quantize(w)
    data_aware = ldlq(q, w, ldl_feedback(h, q.block_cols))
    assert {k: (v.shape, v.dtype) for k, v in data_aware.tensors.items()} == \
        {k: (v.shape, v.dtype) for k, v in nearest.tensors.items()}  # the stored format is unchanged
    assert torch.equal(data_aware.row_scale, nearest.row_scale)  # scales from the unadjusted W
    before = proxy_loss(w, q.dequantize(nearest), h)
    after = proxy_loss(w, q.dequantize(data_aware), h)
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("name", ENTRIES)
def test_uncorrelated_inputs_give_the_data_free_codes(name):
    """H = I (damped or not) and any diagonal H have A = I: every code equals nearest rounding's."""
    q, shape = get_quantizer(name), ENTRIES[name]
    w = weights(shape, seed=3)
    want = q.quantize(w).tensors
    diag = torch.diag(torch.rand(shape[1], generator=torch.Generator().manual_seed(4)) + 0.1)
    for h, damp in ((torch.eye(shape[1]), 0.0), (torch.eye(shape[1]), 0.01), (diag, 0.01)):
        got = ldlq(q, w, ldl_feedback(h, q.block_cols, damp)).tensors
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)


@pytest.mark.parametrize("name", ENTRIES)
def test_lockstep_equals_one_by_one(name, monkeypatch):
    """Matrices of different row counts and Hessians coded together give each its own codes, with
    one coding call per column block for all of them."""
    q, (rows, cols) = get_quantizer(name), ENTRIES[name]
    ws = [weights((rows, cols), seed=8), weights((rows // 2, cols), seed=9) * 3, weights((rows, cols), seed=10)]
    fbs = [ldl_feedback(spd(cols, s), q.block_cols) for s in (11, 12, 13)]
    calls = []
    real = type(q).code_columns
    monkeypatch.setattr(type(q), "code_columns", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    together = ldlq_many(q, ws, fbs)
    assert calls == [rows * 5 // 2] * (cols // q.block_cols)
    for w, fb, got in zip(ws, fbs, together):
        want = ldlq(q, w, fb)
        assert got.shape == want.shape and got.tensors.keys() == want.tensors.keys()
        for k in want.tensors:
            assert torch.equal(got.tensors[k], want.tensors[k]), (name, k)
    with pytest.raises(ValueError, match="one column count"):
        ldlq_many(q, [ws[0], ws[0][:, :16]], fbs[:2])


def test_rotated_hessian_keeps_the_proxy_loss():
    """tr(E H Eᵀ) = tr(E_r H_r E_rᵀ) for E_r = rotate_weight(E), H_r = rotate_hessian(H)."""
    n = 48  # 3·16: a Paley order times a power of two
    h, e = spd(n, 5), weights((32, n), seed=6)
    s = random_signs(n, 7)
    h_r = rotate_hessian(h, s)
    assert torch.equal(h_r, h_r.T)
    assert proxy_loss(rotate_weight(e, s), torch.zeros(32, n), h_r) == pytest.approx(
        proxy_loss(e, torch.zeros(32, n), h), rel=1e-5)
    assert not torch.allclose(h_r, h, atol=1e-3)


def test_hessians_without_signal_or_not_positive_definite():
    assert torch.equal(ldl_feedback(torch.zeros(32, 32), 16), torch.eye(32))
    indefinite = torch.diag(torch.tensor([1.0, -0.5] * 16))
    with pytest.raises(InputError, match="positive definite"):
        ldl_feedback(indefinite, 1, damp=0.0)
    with pytest.raises(InputError, match="negative"):
        ldl_feedback(torch.eye(32), 1, damp=-0.1)
