"""Incoherence processing (docs/method.md §1): random signs + Hadamard along the input dimension.

W_r = W · diag(s) · Hᵀ, so that y = W x = W_r · H(s ⊙ x). Layers fed by the same activation
({q,k,v}, {gate,up}) share one sign vector so that one online transform serves them all.
Signs are stored bit-packed (uint8, bit i of the vector in byte i // 8 at bit 7 − i mod 8).
"""

from __future__ import annotations

import torch

from qpalette.quant.hadamard import hadamard_transform


def random_signs(n: int, seed: int) -> torch.Tensor:
    """±1 float32 vector of length n from a seed (CPU generator: same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).float().mul_(2).sub_(1)


def rotate_weight(w: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """W_r = W · diag(s) · Hᵀ: each row w becomes H(s ⊙ w)."""
    return hadamard_transform(w.float() * signs.to(w.device))


def unrotate_weight(w_r: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate_weight`: W = W_r · H · diag(s)."""
    return hadamard_transform(w_r.float(), transpose=True) * signs.to(w_r.device)


def rotate_hessian(h: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R H Rᵀ for the R = H_n · diag(s) of `rotate_weight` (W_r = W Rᵀ): the input second moment
    E[x xᵀ] seen by W_r, whose inputs are R x. Proxy losses tr(E H Eᵀ) are the same in both bases."""
    hr = rotate_weight(h, signs)  # H Rᵀ
    hr = rotate_weight(hr.T, signs)  # R H Rᵀ (H symmetric)
    return (hr + hr.T) / 2


def rotate_input(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The online transform applied to activations: H(s ⊙ x) over the last dim."""
    return hadamard_transform(x * signs.to(x.device, x.dtype))


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """±1 vector (length a multiple of 8) → uint8 bytes, bit set where the sign is −1."""
    if signs.numel() % 8:
        raise ValueError(f"sign vector of length {signs.numel()} is not a multiple of 8")
    bits = (signs < 0).to(torch.uint8).reshape(-1, 8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=signs.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_signs` → float32 ±1."""
    shifts = torch.arange(7, -1, -1, device=packed.device)
    bits = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return (1 - 2 * bits).reshape(-1).float()
