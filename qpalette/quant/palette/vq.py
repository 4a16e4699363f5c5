"""2-D vector quantizer: each horizontal pair of weights → nearest of 2^(2b) k-means centroids."""

from __future__ import annotations

import torch

from qpalette.quant.bitpack import pack_codes, unpack_codes
from qpalette.quant.codebooks import codebook, nearest
from qpalette.quant.palette.base import Quantizer
from qpalette.quant.tiles import from_tiles, to_tiles


class VQ(Quantizer):
    family = "vq"
    block_cols = 2

    def __init__(self, bits: float):
        self.bits = float(bits)
        self.width = int(round(2 * bits))  # code bits per pair
        self.codebooks = (f"vq.{self.width}",)

    def row_target(self) -> float:
        return 1.0

    def centroids(self, device: torch.device) -> torch.Tensor:
        return codebook(self.codebooks[0]).to(device)

    def code_columns(self, x: torch.Tensor, start: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Centroid index of each horizontal pair (rows × k/2) and the centroids (rows × k)."""
        c = self.centroids(x.device)
        codes = nearest(x.reshape(-1, 2), c).reshape(x.shape[0], -1)
        return codes, c[codes].reshape(x.shape)

    def pack(self, codes: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        spread = codes.repeat_interleave(2, dim=1)  # both weights of a pair carry its code
        return {"codes": pack_codes(to_tiles(spread)[..., ::2], self.width)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        codes = tensors["codes"]
        pairs = self.centroids(codes.device)[unpack_codes(codes, self.width)]
        return from_tiles(pairs.reshape(*codes.shape[:-1], -1))
