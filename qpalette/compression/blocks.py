"""One decoder block → its stored tensors: rotate each input group, quantize every layer (a fused
group as one row-concatenated matrix), by nearest rounding or, given the Hessian of the layer's
input, by LDLQ (quant/ldlq.py; the matrices of several blocks at once, those of one entry and one
column count in lockstep: `code_blocks`); and the shard of everything outside the blocks."""

from __future__ import annotations

from typing import Callable

import torch

from qpalette.compression.source import SourceCheckpoint
from qpalette.models.topology import HEAD, LayerShape, head_layer
from qpalette.quant.codebooks import codebook
from qpalette.quant.incoherence import (
    pack_signs,
    random_signs,
    rotate_hessian,
    rotate_weight,
    unrotate_weight,
)
from qpalette.quant.ldlq import DEFAULT_DAMP, ldl_feedback, ldlq_many
from qpalette.quant.palette import get_quantizer
from qpalette.quant.palette.base import QuantizedMatrix
from qpalette.runtime.checkpoint import CODEBOOKS_MODULE, Layout, parent_and_attr, sign_seed
from qpalette.runtime.modules import buffer_name


def _quantize_rotated(w: torch.Tensor, quantizer: str, signs: torch.Tensor, device,
                      hessian: torch.Tensor | None, damp: float) -> QuantizedMatrix:
    """W rotated (W·diag(s)·Hᵀ) and quantized: nearest rounding, or LDLQ with `hessian` (XᵀX/n
    of its input, original basis) under the same rotation."""
    return _quantize_rotated_many([w], quantizer, [signs], device, None if hessian is None else [hessian], damp)[0]


def _quantize_rotated_many(ws: list[torch.Tensor], quantizer: str, signs: list[torch.Tensor], device,
                           hessians: list[torch.Tensor] | None, damp: float) -> list[QuantizedMatrix]:
    """`_quantize_rotated` of matrices with one column count; with Hessians, LDLQ in lockstep
    (`ldlq_many`)."""
    q = get_quantizer(quantizer)
    w_r = [rotate_weight(w.to(device, torch.float32), s) for w, s in zip(ws, signs)]
    if hessians is None:
        return [q.quantize(w) for w in w_r]
    feedbacks = [ldl_feedback(rotate_hessian(h.to(device, torch.float32), s), q.block_cols, damp)
                 for h, s in zip(hessians, signs)]
    return ldlq_many(q, w_r, feedbacks)


def quantize_matrix(w: torch.Tensor, quantizer: str, signs: torch.Tensor, device,
                    hessian: torch.Tensor | None = None, damp: float = DEFAULT_DAMP
                    ) -> dict[str, torch.Tensor]:
    """Rotate and quantize one matrix (`_quantize_rotated`); the stored tensors on CPU."""
    qm = _quantize_rotated(w, quantizer, signs.to(device), device, hessian, damp)
    return {k: v.cpu() for k, v in qm.tensors.items()}


def quantized_weight(w: torch.Tensor, quantizer: str, signs: torch.Tensor, device,
                     hessian: torch.Tensor | None = None, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """The weight a compressed layer computes with, back in W's basis (float32 on `device`): the
    codes `quantize_matrix` stores, decoded (float32 codebooks), times their fp16 row scales,
    unrotated (Ŵ = Ŵ_r · H · diag(s))."""
    return quantized_weights([w], quantizer, [signs], device, None if hessian is None else [hessian], damp)[0]


def quantized_weights(ws: list[torch.Tensor], quantizer: str, signs: list[torch.Tensor], device,
                      hessians: list[torch.Tensor] | None = None, damp: float = DEFAULT_DAMP) -> list[torch.Tensor]:
    """`quantized_weight` of several matrices with one column count at once (LDLQ in lockstep:
    the same weights as one by one, in far fewer trellis calls)."""
    signs = [s.to(device) for s in signs]
    q = get_quantizer(quantizer)
    return [unrotate_weight(q.dequantize(qm), s)
            for qm, s in zip(_quantize_rotated_many(ws, quantizer, signs, device, hessians, damp), signs)]


def _layer_tensors(w: torch.Tensor, quantizer: str, signs: torch.Tensor, device, random_seed: int | None,
                   hessian: torch.Tensor | None, damp: float) -> dict[str, torch.Tensor]:
    """Stored tensors of one matrix (a fused group row-concatenated); with `random_seed`, random
    code words at the matrix's row scales instead (speed benchmarks of random-weight models)."""
    if random_seed is None:
        return quantize_matrix(w, quantizer, signs, device, hessian, damp)
    q = get_quantizer(quantizer)
    rms = w.float().pow(2).mean(1).sqrt() / q.row_target()
    return q.random_tensors(*w.shape, torch.Generator().manual_seed(random_seed), row_scale=rms)


def quantize_block(src: SourceCheckpoint, block: int, layers: list[LayerShape], layout: Layout,
                   device, half: torch.dtype, on_layer: Callable[[str], None] = lambda n: None,
                   random_codes: bool = False, coded: list[dict[str, torch.Tensor]] | None = None
                   ) -> dict[str, torch.Tensor]:
    """All stored tensors of one decoder block: its matrices by nearest rounding, or `coded`, the
    tensors `code_blocks` made for them (data-aware)."""
    prefix = f"model.layers.{block}."
    mine = [l for l in layers if l.block == block and l.name != HEAD]
    signs = block_signs(block, mine, layout)
    out = {f"{l.rotation}.signs": pack_signs(signs[l.input_group]) for l in mine}
    jobs = block_matrices(mine, layout)
    if coded is None:
        coded = _code_one_by_one(src, jobs, layout, signs, device, block if random_codes else None, on_layer)
    for (target, members, _l), tensors in zip(jobs, coded):
        out.update({f"{target}.{k}": v for k, v in tensors.items()})
        biases = [f"{m}.bias" for m in members if f"{m}.bias" in src.files]
        if biases:
            out[f"{target}.bias"] = torch.cat([src.get(b) for b in biases]).to(half)
    quantized = {f"{l.name}.{s}" for l in mine for s in ("weight", "bias")}
    for name in src.files:
        if name.startswith(prefix) and name not in quantized:
            t = src.get(name)
            out[name] = t.to(half) if t.is_floating_point() else t
    return out


def block_signs(block: int, mine: list[LayerShape], layout: Layout) -> dict[str, torch.Tensor]:
    """Input group → the seeded sign vector its layers are rotated with."""
    return {l.input_group: random_signs(l.in_features, sign_seed(layout.sign_seed, block, l.input_group))
            for l in mine}


def block_matrices(mine: list[LayerShape], layout: Layout) -> list[tuple[str, list[str], LayerShape]]:
    """(stored module name, member layers, first member) of each matrix a block stores: a fused
    group as one, every other layer alone; in layer order."""
    jobs, done = [], set()
    for l in mine:
        if l.name not in done:
            gname = layout.group_of(l.name)
            members = layout.groups[gname] if gname else [l.name]
            jobs.append((gname or l.name, members, l))
            done |= set(members)
    return jobs


def _matrix(src: SourceCheckpoint, members: list[str]) -> torch.Tensor:
    return torch.cat([src.get(f"{m}.weight").float() for m in members])


def _code_one_by_one(src: SourceCheckpoint, jobs: list[tuple[str, list[str], LayerShape]], layout: Layout,
                     signs: dict[str, torch.Tensor], device, random_block: int | None,
                     on_layer: Callable[[str], None]) -> list[dict[str, torch.Tensor]]:
    """The stored tensors of each matrix by nearest rounding (or, with `random_block`, random codes
    seeded per matrix)."""
    out, seen = [], 0
    for target, members, l in jobs:
        on_layer(target)
        seed = None if random_block is None else random_block * 16 + seen
        out.append(_layer_tensors(_matrix(src, members), layout.layers[l.name], signs[l.input_group], device, seed,
                                  None, DEFAULT_DAMP))
        seen += len(members)
    return out


def code_blocks(src: SourceCheckpoint, hessians: dict[int, dict[str, torch.Tensor]], layers: list[LayerShape],
                layout: Layout, device, damp: float = DEFAULT_DAMP, on_layer: Callable[[str], None] = lambda n: None
                ) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Block → the stored tensors (on CPU) of each of its matrices (`block_matrices` order), for
    the blocks of `hessians` (block → input group → H): data-aware, the matrices of one entry and
    one column count of all these blocks through LDLQ together (`ldlq_many`: each gets its own
    codes, and a trellis entry runs one Viterbi batch per column block for all of them)."""
    jobs = []  # (block, index in the block, stored name, members, signs, H)
    for b, hess in hessians.items():
        mine = [l for l in layers if l.block == b and l.name != HEAD]
        signs = block_signs(b, mine, layout)
        jobs += [(b, k, target, members, l, signs[l.input_group], hess[l.input_group])
                 for k, (target, members, l) in enumerate(block_matrices(mine, layout))]
    together: dict[tuple[str, int], list[tuple]] = {}
    for job in jobs:
        together.setdefault((layout.layers[job[4].name], job[4].in_features), []).append(job)
    coded: dict[int, dict[int, dict[str, torch.Tensor]]] = {b: {} for b in hessians}
    for (entry, _cols), group in together.items():
        for job in group:
            on_layer(job[2])
        qms = _quantize_rotated_many([_matrix(src, j[3]) for j in group], entry, [j[5].to(device) for j in group],
                                     device, [j[6] for j in group], damp)
        for (b, k, *_rest), qm in zip(group, qms):
            coded[b][k] = {name: t.cpu() for name, t in qm.tensors.items()}
    return {b: [c[k] for k in range(len(c))] for b, c in coded.items()}


def head_weight(src: SourceCheckpoint, cfg: dict) -> torch.Tensor:
    """lm_head's weight: its own tensor, or the embedding it is tied to."""
    if "lm_head.weight" in src.files and not cfg.get("tie_word_embeddings", False):
        return src.get("lm_head.weight")
    return src.get("model.embed_tokens.weight")


def other_tensors(src: SourceCheckpoint, cfg: dict, layout: Layout, device, half: torch.dtype,
                  random_codes: bool = False, hessians: dict[str, torch.Tensor] | None = None,
                  damp: float = DEFAULT_DAMP) -> dict[str, torch.Tensor]:
    """Embeddings, final norm, lm_head (16-bit unless tied; quantized when the layout names it,
    with its own rotation, data-aware with `hessians`["head"]) and the codebooks (fp16)."""
    out = {}
    quantized_head = HEAD in layout.layers
    for name in src.files:
        if name.startswith("model.layers."):
            continue
        if name == "lm_head.weight" and (quantized_head or cfg.get("tie_word_embeddings", False)):
            continue
        t = src.get(name)
        out[name] = t.to(half) if t.is_floating_point() else t
    if quantized_head:
        w = head_weight(src, cfg).float()
        blocks = cfg["num_hidden_layers"]
        signs = random_signs(w.shape[1], sign_seed(layout.sign_seed, blocks, "head"))
        out[f"{head_layer(cfg).rotation}.signs"] = pack_signs(signs)
        seed = blocks * 16 if random_codes else None
        hessian = hessians["head"] if hessians is not None else None
        for k, v in _layer_tensors(w, layout.layers[HEAD], signs, device, seed, hessian, damp).items():
            out[f"{HEAD}.{k}"] = v
    for cb in layout.codebooks:
        out[f"{CODEBOOKS_MODULE}.{buffer_name(cb)}"] = codebook(cb).to(torch.float16)
    return out


def byte_breakdown(shard_tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, int]:
    """Bytes by the plan's accounting categories (docs/format.md)."""
    quantized_modules = set(layout.groups) | {n for n in layout.layers if not layout.group_of(n)}
    cats = {"codes_and_row_scales": 0, "sign_vectors": 0, "codebooks": 0, "unquantized_modules": 0}
    for name, t in shard_tensors.items():
        module, attr = parent_and_attr(name)
        n = t.numel() * t.element_size()
        if name.startswith(CODEBOOKS_MODULE + "."):
            cats["codebooks"] += n
        elif attr == "signs":
            cats["sign_vectors"] += n
        elif module in quantized_modules and attr != "bias":
            cats["codes_and_row_scales"] += n
        else:
            cats["unquantized_modules"] += n
    cats["total"] = sum(cats.values())
    return cats
