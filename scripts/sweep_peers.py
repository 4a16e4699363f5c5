"""Reference rows of the SmolLM2 sweep that are not qpalette: bitsandbytes NF4 and HQQ through
their transformers-side modules, and plain round-to-nearest (RTN), each with its stored bits per
weight counted from what the quantized layers hold.

Every peer quantizes the same layers as qpalette's bit-budget plans: the nn.Linear layers of the
decoder blocks (lm_head, tied to the embedding in SmolLM2, stays 16-bit in all rows). Bits per
weight = 8 × (bytes of the tensors a layer needs to decode: packed codes, scales, zeros, absmax,
double-quant constants) / its weight count.

- bitsandbytes: `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, blocks of 64
  weights; without double quant each block keeps an fp32 absmax (4 + 32/64 = 4.5 bits); with it,
  absmax is 8-bit in blocks of 256 with fp32 second-level constants (≈ 4.127 bits).
- HQQ: transformers 5.17's `HqqConfig` loading path raises NotImplementedError ("not available
  yet"), so each block linear is replaced by hqq's `HQQLinear` with the settings `HqqConfig`
  passes (nbits, group_size 64, axis 1): fp16 scale and zero per 64 weights (+0.5 bits); 3-bit
  codes are packed ten to an int32 (3.2 bits stored).
- RTN b-bit g-G: `qpalette.quant.rtn` (asymmetric, fp16 scale and zero per group), fake-quantized.
"""

from __future__ import annotations

import re

import torch

BNB_KEYS = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map")
HQQ_KEYS = ("W_q", "scale", "zero")
PEER = re.compile(r"^(?:bnb-nf4(?P<dq>-dq)?|hqq-(?P<hbits>\d)-g(?P<hgroup>\d+)|rtn-(?P<rbits>\d)-g(?P<rgroup>\d+))$")


def is_peer(name: str) -> bool:
    return PEER.match(name) is not None


def block_linears(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module directly under a decoder block that a peer replaces."""
    return [(f"model.layers.{j}.{n}", m) for j, blk in enumerate(model.model.layers) for n, m in blk.named_modules()
            if n and n.endswith("_proj")]


def stored_bits(model, keys: tuple[str, ...]) -> float:
    """Bits per weight of the block linears from the named tensors of their state dicts."""
    bits = numel = 0
    for _name, mod in block_linears(model):
        sd = mod.state_dict()
        bits += 8 * sum(sd[k].numel() * sd[k].element_size() for k in keys if k in sd)
        out_f, in_f = _shape(mod)
        numel += out_f * in_f
    return bits / numel


def _shape(mod) -> tuple[int, int]:
    if hasattr(mod, "meta"):  # HQQLinear
        return tuple(mod.meta["shape"])
    return mod.out_features, mod.in_features


def load_peer(name: str, model_dir, device: torch.device, dtype: torch.dtype):
    """(model, notes) of the peer row `name` on `device`; notes say what was used."""
    m = PEER.match(name)
    if name.startswith("bnb"):
        return _bnb(model_dir, device, dtype, bool(m["dq"]))
    if name.startswith("hqq"):
        return _hqq(model_dir, device, dtype, int(m["hbits"]), int(m["hgroup"]))
    return _rtn(model_dir, device, dtype, int(m["rbits"]), int(m["rgroup"]))


def _bnb(model_dir, device, dtype, double_quant: bool):
    import bitsandbytes
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                             bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=cfg, dtype=dtype,
                                                 device_map=str(device)).eval()
    blocksize = model.model.layers[0].self_attn.q_proj.weight.quant_state.blocksize
    notes = (f"bitsandbytes {bitsandbytes.__version__} NF4, blocksize {blocksize}, double quant "
             f"{'on' if double_quant else 'off'}, compute {str(dtype).removeprefix('torch.')}")
    return model, stored_bits(model, BNB_KEYS), notes


def _hqq(model_dir, device, dtype, nbits: int, group: int):
    import hqq
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    from qpalette.runtime.loading import load_model

    model, _ = load_model(model_dir, device, dtype, tokenizer=False)
    cfg = BaseQuantizeConfig(nbits=nbits, group_size=group, axis=1)
    for name, mod in block_linears(model):
        parent, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), attr, HQQLinear(mod, quant_config=cfg, compute_dtype=dtype,
                                                             device=str(device)))
    notes = (f"hqq {getattr(hqq, '__version__', '?')} HQQLinear, {nbits}-bit, group {group}, axis 1, "
             f"scale and zero in {str(dtype).removeprefix('torch.')}")
    return model, stored_bits(model, HQQ_KEYS), notes


def _rtn(model_dir, device, dtype, nbits: int, group: int):
    from qpalette.quant.rtn import rtn_bits, rtn_fake_quantize
    from qpalette.runtime.loading import load_model

    model, _ = load_model(model_dir, device, torch.float32, tokenizer=False)
    bits = numel = 0
    with torch.no_grad():
        for _name, lin in block_linears(model):
            lin.weight.copy_(rtn_fake_quantize(lin.weight, nbits, group))
            bits += lin.weight.numel() * rtn_bits(nbits, group, lin.weight.shape[1])
            numel += lin.weight.numel()
    notes = f"round-to-nearest {nbits}-bit, group {group}, fp16 scale and zero per group, no rotation"
    return model.to(dtype), bits / numel, notes
