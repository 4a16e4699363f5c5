"""Trellis-coded quantizers: TCQ (bitshift trellis, hybrid LUT, tail-biting) and half-TCQ.

half-TCQ-(a+0.25) codes the first half of the input columns with TCQ-a and the second with
TCQ-(a+0.5); both halves read the larger entry's table and share one row scale.
"""

from __future__ import annotations

import torch

from qpalette.errors import UnsupportedShape
from qpalette.quant.bitpack import pack_bits
from qpalette.quant.codebooks import codebook
from qpalette.quant.palette.base import Quantizer
from qpalette.quant.tiles import TILE, from_tiles, to_tiles
from qpalette.quant.trellis import lut_bits, paths_to_stream, quantize_tiles, state_values, words_to_states

ROW_RMS_FRACTION = 0.9  # rows scaled to 0.9 × RMS(LUT) (docs/method.md §2)


class TCQ(Quantizer):
    family = "tcq"
    block_cols = TILE

    def __init__(self, bits: float, table_q: int | None = None):
        self.bits = float(bits)
        self.kv = int(round(2 * bits))
        self.table_q = table_q or lut_bits(self.kv)
        self.codebooks = (f"tcq.q{self.table_q}",)

    def table(self, device: torch.device) -> torch.Tensor:
        return codebook(self.codebooks[0]).to(device)

    def row_target(self) -> float:
        return ROW_RMS_FRACTION * float(codebook(self.codebooks[0]).pow(2).mean().sqrt())

    def code_columns(self, x: torch.Tensor, start: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tail-biting Viterbi path of every tile ((rows/16) × (k/16) × 128 states) and its values."""
        t = to_tiles(x)
        table = self.table(x.device)
        paths = quantize_tiles(t.reshape(-1, t.shape[-1]), table, self.kv).reshape(*t.shape[:-1], -1)
        values = state_values(table)[paths]
        return paths, from_tiles(values.reshape(*t.shape[:-1], -1))

    def pack(self, codes: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        words = pack_bits(paths_to_stream(codes.reshape(-1, codes.shape[-1]), self.kv))
        return {"codes": words.reshape(*codes.shape[:-1], -1)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        codes = tensors["codes"]
        states = words_to_states(codes.reshape(-1, codes.shape[-1]), self.kv)
        vals = state_values(self.table(codes.device))[states]
        return from_tiles(vals.reshape(*codes.shape[:-1], -1))


class HalfTCQ(Quantizer):
    family = "half-tcq"
    block_cols = TILE

    def __init__(self, bits: float):
        self.bits = float(bits)
        q = lut_bits(int(round(2 * (bits + 0.25))))
        self.halves = (TCQ(bits - 0.25, table_q=q), TCQ(bits + 0.25, table_q=q))
        self.codebooks = self.halves[1].codebooks

    def check_shape(self, rows: int, cols: int) -> None:
        super().check_shape(rows, cols)
        if cols % (2 * TILE):
            raise UnsupportedShape(
                f"shape {rows}×{cols}: half-TCQ splits the input columns in two halves of whole "
                f"16-wide tiles, so columns must be a multiple of {2 * TILE}"
            )

    def tensor_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        self.check_shape(rows, cols)
        a, b = (h.tensor_specs(rows, cols // 2)["codes"] for h in self.halves)
        return {"codes_a": a, "codes_b": b, "row_scale": ((rows,), torch.float16)}

    def row_target(self) -> float:
        return self.halves[1].row_target()

    def code_columns(self, x: torch.Tensor, start: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """TCQ paths as `TCQ.code_columns`, each tile column coded by the half of X it lies in."""
        split = min(max(cols // 2 - start, 0), x.shape[1])  # columns of x in the first half
        parts = [h.code_columns(p, 0, p.shape[1]) for h, p in zip(self.halves, (x[:, :split], x[:, split:]))
                 if p.shape[1]]
        return torch.cat([c for c, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    def pack(self, codes: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        half, mid = (shape[0], shape[1] // 2), shape[1] // (2 * TILE)
        return {
            "codes_a": self.halves[0].pack(codes[:, :mid], half)["codes"],
            "codes_b": self.halves[1].pack(codes[:, mid:], half)["codes"],
        }

    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        half = (shape[0], shape[1] // 2)
        return torch.cat(
            [
                self.halves[0].decode({"codes": tensors["codes_a"]}, half),
                self.halves[1].decode({"codes": tensors["codes_b"]}, half),
            ],
            dim=1,
        )
