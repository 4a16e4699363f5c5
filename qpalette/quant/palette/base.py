"""What every palette entry is: a name, bits per weight, quantize → packed tensors, dequantize.

Quantizers work in the rotated domain (incoherence processing is done by the caller, since
fused layers share one rotation) and own the per-row scaling of docs/method.md §1–§2: each row is
divided by RMS(row)/target, the scale stored in fp16 and multiplied back by dequantize.

Coding is split in two so that LDLQ (qpalette/quant/ldlq.py) can code a matrix a few columns at a
time: `code_columns` rounds a slice of `block_cols`-wide column blocks to raw codes and their
reconstruction, `pack` turns the raw codes of the whole matrix into the stored tensors. The
data-free `encode` is the two applied to the whole matrix at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from qpalette.quant.tiles import TILE, check_tileable


@dataclass
class QuantizedMatrix:
    """Packed result of one quantizer on one (rows × cols) matrix: tensors as stored on disk."""

    quantizer: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def row_scale(self) -> torch.Tensor:
        return self.tensors["row_scale"]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Quantizer(ABC):
    family: str
    bits: float
    #: codebook names (profiles/codebooks.safetensors) this entry reads
    codebooks: tuple[str, ...]
    #: input columns coded jointly, LDLQ's block: a weight (NUQ), a pair (VQ), a 16-wide tile column (trellis)
    block_cols: int

    @property
    def name(self) -> str:
        return f"{self.family}-{format_bits(self.family, self.bits)}"

    def __repr__(self) -> str:
        return f"<quantizer {self.name}>"

    # -- shape and storage -------------------------------------------------------------------
    def check_shape(self, rows: int, cols: int) -> None:
        """Raise tiles.UnsupportedShape if the packed format cannot hold this matrix."""
        check_tileable(rows, cols)

    def code_words_per_tile(self) -> int:
        """int32 words of one 16×16 tile: 256·bits bits."""
        return int(round(256 * self.bits)) // 32

    def tensor_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (shape, dtype) of every tensor `quantize` stores for a rows×cols matrix, so a
        module can allocate matching buffers before loading a checkpoint."""
        self.check_shape(rows, cols)
        return {
            "codes": ((rows // TILE, cols // TILE, self.code_words_per_tile()), torch.int32),
            "row_scale": ((rows,), torch.float16),
        }

    def stored_bytes(self, rows: int, cols: int) -> int:
        """Bytes this entry writes for a rows×cols matrix: codes + fp16 row scales."""
        return sum(
            math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            for shape, dtype in self.tensor_specs(rows, cols).values()
        )

    def random_tensors(self, rows: int, cols: int, generator: torch.Generator | None = None,
                       device: str | torch.device = "cpu",
                       row_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Stored tensors with uniformly random code words (every word sequence is a valid stream
        of every entry) and `row_scale` (default U(0.5, 1.5)): random-weight models for speed
        runs and kernel tests, in seconds instead of a quantizer's minutes. `generator` must live
        on `device`."""
        out = {}
        for name, (shape, dtype) in self.tensor_specs(rows, cols).items():
            if name == "row_scale":
                out[name] = (row_scale.to(device, dtype) if row_scale is not None else
                             (0.5 + torch.rand(shape, generator=generator, device=device)).to(dtype))
            else:
                words = torch.randint(-(2**31), 2**31, shape, generator=generator, device=device,
                                      dtype=torch.int64)
                out[name] = words.to(dtype)
        return out

    # -- numerics ----------------------------------------------------------------------------
    @abstractmethod
    def row_target(self) -> float:
        """RMS each row is scaled to before coding."""

    @abstractmethod
    def code_columns(self, x: torch.Tensor, start: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw codes, reconstruction) of x = X[:, start:start + k], whole `block_cols` blocks of a
        row-normalised rows × cols matrix X, each block rounded to its nearest code. Raw codes keep
        the column blocks along dim 1, so the codes of consecutive slices concatenate
        (torch.cat(dim=1)) into the matrix's, which `pack` stores."""

    @abstractmethod
    def pack(self, codes: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The stored code tensors of a rows × cols matrix from the raw codes of all its columns."""

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Codes for a row-normalised matrix x (rows × cols, float32): nearest rounding."""
        return self.pack(self.code_columns(x, 0, x.shape[1])[0], tuple(x.shape))

    @abstractmethod
    def decode(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Row-normalised reconstruction (float32) from the code tensors."""

    def normalise(self, w: torch.Tensor, row_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w with each row divided by its scale, the fp16 row scales): the scales are RMS(row)/target
        unless given; an all-zero row keeps scale 0 and stays zero."""
        rows, cols = w.shape
        self.check_shape(rows, cols)
        w = w.float()
        if row_scale is None:
            rms = w.pow(2).mean(dim=1).sqrt()
            row_scale = (rms / self.row_target()).to(torch.float16)
        scale = row_scale.to(w.device, torch.float32)
        x = w / torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(1)
        return x, row_scale.to(w.device, torch.float16)

    def quantize(self, w: torch.Tensor, row_scale: torch.Tensor | None = None) -> QuantizedMatrix:
        """Quantize w (rows × cols) on its own device; `row_scale` reuses given fp16 scales."""
        x, row_scale = self.normalise(w, row_scale)
        tensors = self.encode(x)
        tensors["row_scale"] = row_scale
        return QuantizedMatrix(self.name, tuple(w.shape), tensors)

    def dequantize(self, q: QuantizedMatrix) -> torch.Tensor:
        if q.quantizer != self.name:
            raise ValueError(f"{q.quantizer} codes given to {self.name}")
        x = self.decode(q.tensors, q.shape)
        return x * q.row_scale.to(x.device, torch.float32).unsqueeze(1)


def format_bits(family: str, bits: float) -> str:
    if family == "nuq":
        return str(int(bits))
    if family == "half-tcq":
        return f"{bits:.2f}"
    return f"{bits:.1f}"
