import numpy as np
import pytest
import torch

from qpalette.errors import UnsupportedShape
from qpalette.quant.hadamard import decompose, dense_hadamard, hadamard_matrix, hadamard_transform
from qpalette.quant.incoherence import (
    pack_signs,
    random_signs,
    rotate_input,
    rotate_weight,
    unpack_signs,
    unrotate_weight,
)

# docs/method.md §1's K orders that a Paley construction reaches, plus the larger ones we use instead of 116/156/172
ORDERS = [12, 20, 28, 36, 52, 60, 76, 100, 108, 124, 140, 148, 312, 344, 464]
# hidden and intermediate sizes of Llama 2/3, Qwen2.5/3, Mistral and SmolLM2 models
MODEL_SIZES = [576, 1536, 960, 2560, 2048, 8192, 3072, 4096, 11008, 14336, 28672, 5120, 13824,
               3584, 18944, 896, 4864, 8960, 27648, 29568, 1024, 6144, 9728, 12288, 17408, 25600]


@pytest.mark.parametrize("k", ORDERS)
def test_k_orders_are_hadamard(k):
    h = hadamard_matrix(k)
    assert set(np.unique(h)) == {-1, 1}
    hf = h.astype(np.float64)
    assert np.array_equal(hf @ hf.T, k * np.eye(k))


@pytest.mark.parametrize("n", MODEL_SIZES)
def test_model_sizes_are_orthogonal(n):
    """H = H_K ⊗ H_{2^m}/√n is orthogonal iff its factors are Hadamard; check the factors
    exactly, then the fast transform on the identity's rows for small n, and isometry for all."""
    k, p2 = decompose(n)
    assert k * p2 == n
    for order in (k, min(p2, 1024)):  # Sylvester factors above 1024 are Kronecker powers of these
        h = hadamard_matrix(order).astype(np.float64)  # BLAS; exact for these integer sums
        assert np.array_equal(h @ h.T, order * np.eye(order))
    if n <= 2048:
        h = dense_hadamard(n)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-10)
    x = torch.randn(2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y = hadamard_transform(x)
    assert torch.allclose(y @ y.T, x @ x.T, atol=1e-8)


@pytest.mark.parametrize("n", [16, 64, 576, 1536, 4096, 14336, 11008])
def test_fast_transform_matches_dense_and_inverts(n):
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y = hadamard_transform(x)
    if n <= 2048:
        assert torch.allclose(y, x @ dense_hadamard(n).T, atol=1e-10)
    assert torch.allclose(hadamard_transform(y, transpose=True), x, atol=1e-10)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))


def test_spec_examples_decompose_as_documented():
    assert decompose(576) == (36, 16)
    assert decompose(1536) == (12, 128)
    assert decompose(14336) == (28, 512)
    assert decompose(3072) == (12, 256)
    assert decompose(4096) == (1, 4096)


@pytest.mark.parametrize("n", [0, 6, 10, 116, 172, 156, 2 * 3 * 5 * 7 * 11])
def test_unsupported_sizes_are_reported(n):
    with pytest.raises(UnsupportedShape):
        decompose(n)


def test_rotation_then_inverse_is_identity_and_preserves_products():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 576, generator=g, dtype=torch.float64)
    x = torch.randn(5, 576, generator=g, dtype=torch.float64)
    s = random_signs(576, seed=3).double()
    w_r = rotate_weight(w, s).double()
    assert torch.allclose(unrotate_weight(w_r, s).double(), w, atol=1e-5)
    # y = W x = W_r · H(s ⊙ x)
    assert torch.allclose(rotate_input(x, s) @ w_r.T, x @ w.T, atol=1e-4)


def test_signs_are_seeded_and_pack_round_trip():
    a, b, c = random_signs(1536, 7), random_signs(1536, 7), random_signs(1536, 8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    packed = pack_signs(a)
    assert packed.dtype == torch.uint8 and packed.numel() == 1536 // 8
    assert torch.equal(unpack_signs(packed), a)


def test_transform_on_device_matches_cpu(device):
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(hadamard_transform(x.to(device)).cpu(), hadamard_transform(x), atol=1e-5)
