"""`qpalette.quantize`: a loaded transformers model quantized in place, with the same modules and
the same numbers as `compress` followed by loading the checkpoint: the same per-block code
(blocks.py) fed from the model's own tensors (source.StateDictSource) instead of safetensors
files, and the stored tensors loaded into the converted model as the loader would."""

from __future__ import annotations

from pathlib import Path

import torch

from qpalette.compression.blocks import code_blocks, other_tensors, quantize_block
from qpalette.compression.layout import resolve_layout
from qpalette.compression.source import StateDictSource, half_dtype
from qpalette.compression.writer import data_aware_record, open_hessians
from qpalette.config import CompressConfig
from qpalette.devices import resolve_device
from qpalette.errors import InputError, ModelError
from qpalette.models.experts import unfuse_experts
from qpalette.models.topology import HEAD, check_config
from qpalette.runtime.checkpoint import convert_model
from qpalette.runtime.loading import is_quantized


def quantize_model(model, plan_file: Path | None, config: CompressConfig, *, hessians: str | Path | None = None,
                   device: str = "auto", random_codes: bool = False):
    """Quantize `model` (a transformers causal LM) in place and return it: with `config.scheme`
    for every layer, or the plan in `plan_file`, on the layers `config.targets`/`ignore` choose
    (models/walk.py); LDLQ on the `hessians` folder when given; `device`: where to quantize;
    `random_codes`: random code words instead of the quantizer's (speed measurements only)."""
    if is_quantized(model):
        raise InputError("this model is already quantized")
    if random_codes and hessians is not None:
        raise InputError("random codes and Hessians exclude each other: random codes skip the quantizer")
    cfg = model.config.to_dict()
    try:
        check_config(cfg)
    except ModelError as e:
        raise InputError(str(e)) from None
    layout, _, layers = resolve_layout(cfg, config.scheme, plan_file, config.lm_head, config.fuse, config.sign_seed,
                                       config.targets, config.ignore)
    unfuse_experts(model)  # the state dict then names each expert's layers
    src, half, dev = StateDictSource(model.state_dict()), half_dtype(cfg), resolve_device(device)
    hess = open_hessians(None if hessians is None else Path(hessians), config.damp, src, cfg, layers)
    tensors: dict[str, torch.Tensor] = {}
    for block in range(cfg["num_hidden_layers"]):
        coded = None if hess is None else code_blocks(src, {block: hess.load(block)}, layers, layout, dev,
                                                      config.damp)[block]
        tensors.update(quantize_block(src, block, layers, layout, dev, half, random_codes=random_codes, coded=coded))
    head_h = hess.load(cfg["num_hidden_layers"]) if hess is not None and HEAD in layout.layers else None
    tensors.update(other_tensors(src, cfg, layout, dev, half, random_codes, hessians=head_h, damp=config.damp))
    where, dtype = model.device, model.dtype
    if HEAD in layout.layers:
        model.config.tie_word_embeddings = False  # the embedding stays 16-bit, lm_head gets its codes
    convert_model(model, layout, dtype)
    _load(model, tensors)
    data_aware = data_aware_record(hess, config.damp)
    model.config.quantization_config = layout.to_config({"data_aware": data_aware} if data_aware else None)
    return model.to(where).eval()


def _load(model, tensors: dict[str, torch.Tensor]) -> None:
    """The stored tensors into the converted model (copied, cast to each parameter's dtype, as the
    loader does); refuse a name the model does not have."""
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=False)
    if unexpected:
        raise InputError(f"quantized tensors the model has no place for: {unexpected[:3]}")
    left = [m for m in missing if not m.endswith(("rotary_emb.inv_freq", "lm_head.weight"))]
    if left:
        raise InputError(f"model tensors the quantizer did not produce: {left[:3]}")
