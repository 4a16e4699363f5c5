"""One decoder block → its stored tensors: rotate each input group, quantize every layer (a fused
group as one row-concatenated matrix); and the shard of everything outside the blocks."""

from __future__ import annotations

from typing import Callable

import torch

from qpalette.compression.source import SourceCheckpoint
from qpalette.models.topology import LayerShape
from qpalette.quant.codebooks import codebook
from qpalette.quant.incoherence import pack_signs, random_signs, rotate_weight
from qpalette.quant.palette import get_quantizer
from qpalette.runtime.checkpoint import CODEBOOKS_MODULE, Layout, parent_and_attr, sign_seed
from qpalette.runtime.modules import buffer_name


def quantize_matrix(w: torch.Tensor, quantizer: str, signs: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """Rotate (W·diag(s)·Hᵀ) and quantize one matrix; the stored tensors on CPU."""
    q = get_quantizer(quantizer)
    qm = q.quantize(rotate_weight(w.to(device, torch.float32), signs.to(device)))
    return {k: v.cpu() for k, v in qm.tensors.items()}


def quantize_block(src: SourceCheckpoint, block: int, layers: list[LayerShape], layout: Layout,
                   device, half: torch.dtype, on_layer: Callable[[str], None] = lambda n: None,
                   random_codes: bool = False) -> dict[str, torch.Tensor]:
    """All stored tensors of one decoder block."""
    prefix = f"model.layers.{block}."
    mine = [l for l in layers if l.block == block]
    out: dict[str, torch.Tensor] = {}
    signs: dict[str, torch.Tensor] = {}
    for l in mine:
        if l.input_group not in signs:
            signs[l.input_group] = random_signs(l.in_features, sign_seed(layout.sign_seed, block, l.input_group))
            out[f"{layout.rotation_of(l.name)}.signs"] = pack_signs(signs[l.input_group])
    done: set[str] = set()
    for l in mine:
        if l.name in done:
            continue
        gname = layout.group_of(l.name)
        members = layout.groups[gname] if gname else [l.name]
        on_layer(gname or l.name)
        w = torch.cat([src.get(f"{m}.weight").float() for m in members])
        target = gname or l.name
        if random_codes:
            q = get_quantizer(layout.layers[l.name])
            rms = w.float().pow(2).mean(1).sqrt() / q.row_target()
            gen = torch.Generator().manual_seed(block * 16 + len(done))
            tensors = q.random_tensors(*w.shape, gen, row_scale=rms)
        else:
            tensors = quantize_matrix(w, layout.layers[l.name], signs[l.input_group], device)
        for k, v in tensors.items():
            out[f"{target}.{k}"] = v
        biases = [f"{m}.bias" for m in members if f"{m}.bias" in src.files]
        if biases:
            out[f"{target}.bias"] = torch.cat([src.get(b) for b in biases]).to(half)
        done |= set(members)
    quantized = {f"{l.name}.{s}" for l in mine for s in ("weight", "bias")}
    for name in src.files:
        if name.startswith(prefix) and name not in quantized:
            t = src.get(name)
            out[name] = t.to(half) if t.is_floating_point() else t
    return out


def other_tensors(src: SourceCheckpoint, cfg: dict, layout: Layout, half: torch.dtype) -> dict[str, torch.Tensor]:
    """Embeddings, final norm, lm_head (unless tied) in 16-bit, and the codebooks (fp16)."""
    out = {}
    for name in src.files:
        if name.startswith("model.layers."):
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            continue
        t = src.get(name)
        out[name] = t.to(half) if t.is_floating_point() else t
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
