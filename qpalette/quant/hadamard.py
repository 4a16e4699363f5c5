"""Hadamard matrices of order K·2^m and the fast normalized transform (docs/method.md §1).

Orders that are not powers of two are built with Paley's constructions over GF(q) (q a prime
power), so no matrix is tabulated: Paley I gives order q+1 for q ≡ 3 (mod 4), Paley II gives
2(q+1) for q ≡ 1 (mod 4). For a size n we pick the smallest such K with n = K·2^m and apply
H = H_K ⊗ H_{2^m} / √n as a dense K×K product and a butterfly over the 2^m part.
The paper's list (12, 20, ..., 172) is all covered except 116, 156 and 172, which no Paley
construction reaches; sizes whose odd factor needs them use a larger K·2^j instead (464, 312,
344: e.g. Llama-2's 11008 = 344·32).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from qpalette.errors import UnsupportedShape

MAX_DENSE_ORDER = 1024  # largest K we build; beyond that the online transform would be slow


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = p^k, or None."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)
    k, r = 0, q
    while r % p == 0:
        r //= p
        k += 1
    return (p, k) if r == 1 else None


def _poly_mulmod(a: list[int], b: list[int], mod: list[int], p: int) -> list[int]:
    """Product of two polynomials (low coefficient first) modulo a monic polynomial over GF(p)."""
    k = len(mod) - 1
    prod = [0] * (2 * k - 1)
    for i, ai in enumerate(a):
        for j, bj in enumerate(b):
            prod[i + j] = (prod[i + j] + ai * bj) % p
    for d in range(len(prod) - 1, k - 1, -1):
        c = prod[d]
        if c:
            for i in range(k + 1):
                prod[d - k + i] = (prod[d - k + i] - c * mod[i]) % p
    return prod[:k]


def _irreducible(p: int, k: int) -> list[int]:
    """A monic irreducible polynomial of degree k over GF(p) (low coefficient first)."""
    if k == 1:
        return [0, 1]
    for code in range(p**k):
        coeffs = [(code // p**i) % p for i in range(k)] + [1]
        if coeffs[0] == 0:
            continue
        if _has_no_factor(coeffs, p):
            return coeffs
    raise AssertionError("no irreducible polynomial found")  # cannot happen


def _has_no_factor(f: list[int], p: int) -> bool:
    k = len(f) - 1
    for deg in range(1, k // 2 + 1):
        for code in range(p**deg):
            g = [(code // p**i) % p for i in range(deg)] + [1]
            if _poly_rem_zero(f, g, p):
                return False
    return True


def _poly_rem_zero(f: list[int], g: list[int], p: int) -> bool:
    r = list(f)
    dg = len(g) - 1
    for d in range(len(r) - 1, dg - 1, -1):
        c = r[d]
        if c:
            for i in range(dg + 1):
                r[d - dg + i] = (r[d - dg + i] - c * g[i]) % p
    return not any(r[:dg])


def _quadratic_character_table(q: int) -> np.ndarray:
    """chi[a, b] = χ(a − b) over GF(q) with elements numbered 0..q-1 (base-p digits)."""
    p, k = _prime_power(q)  # type: ignore[misc]
    digits = np.array([[(e // p**i) % p for i in range(k)] for e in range(q)])
    weights = p ** np.arange(k)
    if k == 1:
        squares = {(x * x) % p for x in range(1, p)}
    else:
        mod = _irreducible(p, k)
        squares = set()
        for e in range(1, q):
            sq = _poly_mulmod(list(digits[e]), list(digits[e]), mod, p)
            squares.add(int(np.dot(sq, weights)))
    chi_of = np.full(q, -1, dtype=np.int64)
    chi_of[0] = 0
    chi_of[list(squares)] = 1
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    return chi_of[diff @ weights]


def _paley_kind(order: int) -> tuple[str, int] | None:
    if order % 4:
        return None
    if _prime_power(order - 1) and (order - 1) % 4 == 3:
        return ("I", order - 1)
    half = order // 2
    if _prime_power(half - 1) and (half - 1) % 4 == 1:
        return ("II", half - 1)
    return None


@functools.lru_cache(maxsize=None)
def hadamard_matrix(order: int) -> np.ndarray:
    """An unnormalized ±1 Hadamard matrix of `order` (1, 2, 2^m or Paley-constructible K·2^m)."""
    if order == 1:
        return np.ones((1, 1), dtype=np.int64)
    if order % 2 == 0 and (order & (order - 1)) == 0:
        h2 = np.array([[1, 1], [1, -1]], dtype=np.int64)
        return np.kron(h2, hadamard_matrix(order // 2))
    kind = _paley_kind(order)
    if kind is None:
        raise UnsupportedShape(f"no Paley construction for Hadamard order {order}")
    name, q = kind
    chi = _quadratic_character_table(q)
    if name == "I":
        s = np.zeros((q + 1, q + 1), dtype=np.int64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = chi
        return np.eye(q + 1, dtype=np.int64) + s
    c = np.zeros((q + 1, q + 1), dtype=np.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = chi
    return np.kron(c, np.array([[1, 1], [1, -1]])) + np.kron(
        np.eye(q + 1, dtype=np.int64), np.array([[1, -1], [-1, -1]])
    )


@functools.lru_cache(maxsize=None)
def decompose(n: int) -> tuple[int, int]:
    """(K, 2^m) with n = K·2^m and K the smallest order we can construct; raises if none."""
    if n < 1:
        raise UnsupportedShape(f"size {n} must be positive")
    two = n & -n
    odd = n // two
    if odd == 1:
        return 1, n
    k = odd
    while k <= min(n, MAX_DENSE_ORDER):
        if n % k == 0 and _paley_kind(k) is not None:
            return k, n // k
        k *= 2
    raise UnsupportedShape(
        f"size {n} = {odd}·2^{two.bit_length() - 1}: no Hadamard order {odd}·2^j ≤ "
        f"{MAX_DENSE_ORDER} dividing it is Paley-constructible"
    )


@functools.lru_cache(maxsize=None)
def _dense_factor(k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.from_numpy(hadamard_matrix(k)).to(dtype=dtype, device=device)


def _fwht_pow2(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Sylvester transform over the last dim (a power of two), natural order."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        x = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return x.reshape(*lead, n)


def hadamard_transform(x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """y = H x over the last dim with H = (H_K ⊗ H_{2^m})/√n orthonormal; `transpose` applies Hᵀ.

    Paley-I factors are not symmetric, so the inverse of the transform is its transpose.
    """
    n = x.shape[-1]
    k, p2 = decompose(n)
    y = _fwht_pow2(x.reshape(*x.shape[:-1], k, p2))
    if k > 1:
        hk = _dense_factor(k, x.dtype, str(x.device))
        y = torch.einsum("ij,...jb->...ib", hk.T if transpose else hk, y)
    return y.reshape(x.shape) / math.sqrt(n)


def dense_hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized n×n matrix the fast transform applies (for tests and small references)."""
    k, p2 = decompose(n)
    h = np.kron(hadamard_matrix(k), hadamard_matrix(p2)) / math.sqrt(n)
    return torch.from_numpy(h).to(dtype)
