"""Scalar non-uniform quantizer: nearest level of a 2^b-entry Lloyd–Max codebook of N(0,1)."""

from __future__ import annotations

import torch

from qpalette.quant.bitpack import pack_codes, unpack_codes
from qpalette.quant.codebooks import codebook
from qpalette.quant.palette.base import Quantizer
from qpalette.quant.tiles import from_tiles, to_tiles


class NUQ(Quantizer):
    family = "nuq"
    block_cols = 1

    def __init__(self, bits: int):
        self.bits = float(bits)
        self.width = int(bits)
        self.codebooks = (f"nuq.{self.width}",)

    def row_target(self) -> float:
        return 1.0

    def levels(self, device: torch.device) -> torch.Tensor:
        return codebook(self.codebooks[0]).to(device)

    def code_columns(self, x: torch.Tensor, start: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Level index of each weight (rows × k) and the level."""
        lv = self.levels(x.device)
        codes = torch.bucketize(x.contiguous(), (lv[1:] + lv[:-1]) / 2)
        return codes, lv[codes]

    def pack(self, codes: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        return {"codes": pack_codes(to_tiles(codes), self.width)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        codes = tensors["codes"]
        return from_tiles(self.levels(codes.device)[unpack_codes(codes, self.width)])
