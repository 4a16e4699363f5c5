"""The in-memory code layout the kernels read ("lane-major"), made from the checkpoint's at load.

A checkpoint stores each 16×16 tile's code bits as one stream (docs/format.md); lane ℓ of the
decoding warp owns the W bits at stream offset ℓ·W (W = the tile's int32 words). The GEMV wants
each lane's bits for several tiles in one coalesced 16-byte load, so at load time the codes are
regrouped, a pure bit permutation:

- a *group* is 8 consecutive tiles of one row tile (the last group of a row padded with zero
  tiles, whose activations the kernel reads as zeros);
- in a group, lane ℓ's *lane stream* is its own bits of tiles 0..7 concatenated, MSB first:
  8·W bits = W/4 words (`group_words`);
- a group's 32 lane streams form one block, stored in *planes* so that every load instruction of
  a warp reads 512 contiguous bytes: 16-byte planes (lane ℓ's words 4p..4p+3 at 128p + 4ℓ), then
  an 8-byte and a 4-byte plane for the remaining 2 and 1 words (`block_order`);
- blocks in (row tile, group) order: the stored tensor is (row tiles, groups, 32·W/4) int32;
- TCQ with KV = 6 (24 bits a lane and tile) reorders each lane stream's 24 bytes so that its
  decoder needs no funnel shifts (`KV6_BYTES`).

half-TCQ keeps its two halves as two such tensors; the second half's lanes hold one word more, laid
out as the first half's planes and then that word's own plane (`block_order`). Only the code tensors
change; `unpack` gives back the checkpoint's tensors exactly (state dicts and the CPU reference use
it). The same definition in CUDA is `qpalette_lanes.cuh`.
"""

from __future__ import annotations

import functools

import torch

from qpalette.quant.bitpack import pack_bits, unpack_bits
from qpalette.quant.palette import get_quantizer

GROUP_TILES = 8
LANES = 32
ROW_TILES_A_CHUNK = 16  # row tiles repacked at once: bounds the bit-level scratch memory


# KV-6 lane streams: word j < 6 = [b2_j, y_j, b0_j, b1_j] (MSB first), b0..b2 tile j's bytes in
# stream order; the spare bytes y_0..y_2 hold tile 6's bytes, y_3..y_5 tile 7's. Then a tile's first
# window is the word's low half, the second a rotate of the word and the last two shifts of one byte
# permute with lane ℓ+1's word (TcqLanes<6> in qpalette_lanes.cuh). New byte i ← old byte KV6_BYTES[i].
KV6_BYTES = torch.tensor([b for j in range(6) for b in (3 * j + 2, 18 + j, 3 * j, 3 * j + 1)])
KV6_INVERSE = torch.argsort(KV6_BYTES)


def kv6_names(quantizer: str) -> tuple[str, ...]:
    """The code tensors holding TCQ codes of KV = 6 (lane streams in the KV6_BYTES order)."""
    q = get_quantizer(quantizer)
    if q.family == "tcq":
        return ("codes",) if q.kv == 6 else ()
    if q.family == "half-tcq":
        return tuple(n for n, h in zip(("codes_a", "codes_b"), q.halves) if h.kv == 6)
    return ()


def code_names(quantizer: str) -> tuple[str, ...]:
    """The stored tensors holding codes (the others, row scales, pass through unchanged)."""
    return ("codes_a", "codes_b") if get_quantizer(quantizer).family == "half-tcq" else ("codes",)


def group_words(tile_words: int) -> int:
    """int32 words of one lane's stream in one group: 8 tiles × W bits."""
    return tile_words * GROUP_TILES // LANES


def groups(col_tiles: int) -> int:
    return -(-col_tiles // GROUP_TILES)


@functools.lru_cache(maxsize=None)
def block_order(wpg: int, second_half: bool = False) -> torch.Tensor:
    """pos[ℓ·wpg + q] = where lane ℓ's word q lives in a block (planes of 4, then 2, then 1).
    `second_half`: half-TCQ's second half, whose lanes hold one word more than the first half's: the
    first half's planes, then that word as a plane of its own, so that the GEMV loads a group of
    either half with the same instructions (load_group_either in qpalette_gemv.cuh)."""
    if second_half:
        first = block_order(wpg - 1).view(LANES, wpg - 1)
        last = LANES * (wpg - 1) + torch.arange(LANES).view(LANES, 1)
        return torch.cat([first, last], 1).reshape(-1)
    full = wpg // 4 * 4
    pos = []
    for lane in range(LANES):
        for q in range(wpg):
            if q < full:
                pos.append((q // 4) * 4 * LANES + lane * 4 + q % 4)
            elif q < full + 2 and wpg - full >= 2:
                pos.append(full * LANES + lane * 2 + (q - full))
            else:
                pos.append((wpg - 1) * LANES + lane)
    return torch.tensor(pos, dtype=torch.long)


def _reorder_bytes(streams: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Lane streams (..., 192 bits) with their 24 bytes taken in `order`."""
    return streams.reshape(*streams.shape[:-1], 24, 8)[..., order.to(streams.device), :].reshape(streams.shape)


def _pack_rows(codes: torch.Tensor, kv6: bool, second_half: bool) -> torch.Tensor:
    rt, ct, w = codes.shape
    cg = groups(ct)
    padded = torch.zeros((rt, cg * GROUP_TILES, w), dtype=codes.dtype, device=codes.device)
    padded[:, :ct] = codes
    bits = unpack_bits(padded).reshape(rt, cg, GROUP_TILES, LANES, w)  # tile stream: lane-major
    streams = bits.permute(0, 1, 3, 2, 4).reshape(rt, cg, LANES, -1)   # each lane's 8 tiles
    if kv6:
        streams = _reorder_bytes(streams, KV6_BYTES)
    words = pack_bits(streams).reshape(rt, cg, -1)
    out = torch.empty_like(words)
    out[..., block_order(group_words(w), second_half).to(codes.device)] = words
    return out


def _unpack_rows(lanes: torch.Tensor, col_tiles: int, tile_words: int, kv6: bool, second_half: bool) -> torch.Tensor:
    rt, cg, _ = lanes.shape
    words = lanes[..., block_order(group_words(tile_words), second_half).to(lanes.device)]
    streams = unpack_bits(words.reshape(rt, cg, LANES, -1))
    if kv6:
        streams = _reorder_bytes(streams, KV6_INVERSE)
    bits = streams.reshape(rt, cg, LANES, GROUP_TILES, tile_words)
    tiles = pack_bits(bits.permute(0, 1, 3, 2, 4).reshape(rt, cg * GROUP_TILES, -1))
    return tiles[:, :col_tiles].contiguous()


def pack_codes(codes: torch.Tensor, kv6: bool = False, second_half: bool = False) -> torch.Tensor:
    """Checkpoint codes (row tiles, col tiles, W) → lane-major (row tiles, groups, 32·W/4); `kv6`:
    TCQ codes of KV = 6 (W = 24), lane streams in the KV6_BYTES order; `second_half`: half-TCQ's
    second half (`block_order`)."""
    if kv6 and codes.shape[-1] != 24:
        raise ValueError(f"KV-6 byte order needs 24-word tiles, got {codes.shape[-1]}")
    parts = [_pack_rows(codes[i : i + ROW_TILES_A_CHUNK], kv6, second_half)
             for i in range(0, codes.shape[0], ROW_TILES_A_CHUNK)]
    if not parts:
        return codes.new_empty((0, groups(codes.shape[1]), LANES * group_words(codes.shape[2])))
    return torch.cat(parts)


def unpack_codes(lanes: torch.Tensor, col_tiles: int, tile_words: int, kv6: bool = False,
                 second_half: bool = False) -> torch.Tensor:
    """Inverse of `pack_codes` (the padding tiles dropped)."""
    parts = [_unpack_rows(lanes[i : i + ROW_TILES_A_CHUNK], col_tiles, tile_words, kv6, second_half)
             for i in range(0, lanes.shape[0], ROW_TILES_A_CHUNK)]
    if not parts:
        return lanes.new_empty((0, col_tiles, tile_words))
    return torch.cat(parts)


def _layout(quantizer: str, name: str) -> dict[str, bool]:
    """How the code tensor `name` of this quantizer is regrouped: `pack_codes`' kv6 and second_half."""
    return {"kv6": name in kv6_names(quantizer), "second_half": name == "codes_b"}


def pack_named(quantizer: str, name: str, codes: torch.Tensor) -> torch.Tensor:
    """`pack_codes` for the code tensor `name` of a layer of this quantizer."""
    return pack_codes(codes, **_layout(quantizer, name))


def pack(quantizer: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's stored tensors → the runtime's (code tensors lane-major)."""
    out = dict(tensors)
    for name in code_names(quantizer):
        out[name] = pack_named(quantizer, name, tensors[name])
    return out


def unpack(quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The runtime's tensors → exactly the checkpoint's (inverse of `pack`)."""
    specs = get_quantizer(quantizer).tensor_specs(*shape)
    out = dict(tensors)
    for name in code_names(quantizer):
        (_, ct, w), _ = specs[name]
        out[name] = unpack_codes(tensors[name], ct, w, **_layout(quantizer, name))
    return out
