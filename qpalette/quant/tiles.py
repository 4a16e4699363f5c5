"""16×16 weight tiles in tensor-core A-fragment order.

A tile of W (rows = output features, cols = input features) is the A operand of one
mma.m16n8k16. Lane ℓ of the warp holds, in register order, the pairs
(g, 2c), (g+8, 2c), (g, 2c+8), (g+8, 2c+8) with g = ℓ>>2, c = ℓ&3, each pair being two
horizontally adjacent weights. Storing a tile's 256 weights in that order means lane ℓ owns
the contiguous positions 8ℓ .. 8ℓ+7 (pairs 4ℓ .. 4ℓ+3) of every code stream.
"""

from __future__ import annotations

import functools

import torch

from qpalette.errors import UnsupportedShape

TILE = 16
TILE_WEIGHTS = TILE * TILE


@functools.lru_cache(maxsize=None)
def fragment_order() -> torch.Tensor:
    """perm[p] = row·16 + col of the weight stored at position p of a tile."""
    perm = []
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for j in range(4):
            row = g + 8 * (j & 1)
            col = 2 * c + 8 * (j >> 1)
            perm += [row * TILE + col, row * TILE + col + 1]
    return torch.tensor(perm, dtype=torch.long)


def check_tileable(rows: int, cols: int) -> None:
    if rows <= 0 or cols <= 0 or rows % TILE or cols % TILE:
        raise UnsupportedShape(f"shape {rows}×{cols}: both dimensions must be positive multiples of {TILE}")


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """(R, C) → (R/16, C/16, 256) with each tile in fragment order."""
    rows, cols = w.shape
    check_tileable(rows, cols)
    t = w.reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3)
    t = t.reshape(rows // TILE, cols // TILE, TILE_WEIGHTS)
    return t[..., fragment_order().to(w.device)]


def from_tiles(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_tiles`."""
    tr, tc, _ = t.shape
    inv = torch.argsort(fragment_order()).to(t.device)
    t = t[..., inv].reshape(tr, tc, TILE, TILE).permute(0, 2, 1, 3)
    return t.reshape(tr * TILE, tc * TILE)
