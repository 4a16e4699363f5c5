"""2-D vector quantizer: each horizontal pair of weights → nearest of 2^(2b) k-means centroids."""

from __future__ import annotations

import torch

from qpalette.quant.bitpack import pack_codes, unpack_codes
from qpalette.quant.codebooks import codebook, nearest
from qpalette.quant.palette.base import Quantizer
from qpalette.quant.tiles import from_tiles, to_tiles


class VQ(Quantizer):
    family = "vq"

    def __init__(self, bits: float):
        self.bits = float(bits)
        self.width = int(round(2 * bits))  # code bits per pair
        self.codebooks = (f"vq.{self.width}",)

    def row_target(self) -> float:
        return 1.0

    def centroids(self, device: torch.device) -> torch.Tensor:
        return codebook(self.codebooks[0]).to(device)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        t = to_tiles(x)
        pairs = t.reshape(-1, 2)
        codes = nearest(pairs, self.centroids(x.device)).reshape(*t.shape[:-1], -1)
        return {"codes": pack_codes(codes, self.width)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        codes = tensors["codes"]
        pairs = self.centroids(codes.device)[unpack_codes(codes, self.width)]
        return from_tiles(pairs.reshape(*codes.shape[:-1], -1))
