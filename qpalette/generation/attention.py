"""Decode attention for grouped-query models: one kernel over the cache as it is.

Why: with an attention mask (a static cache always has one), transformers' sdpa path expands the
whole key/value cache to every query head (`repeat_kv`) before calling SDPA, on every layer of
every decode step (under torch.compile even where its eager path packs the heads), and SDPA's
kernels are prefill kernels. With one query token, the G query heads that share a KV head are G
queries against that head's keys: `qpalette::decode_attention` (runtime/decode_attention.py) runs
them on the cache as it is, split over its length. Everything else (prefill, dropout, softcap, a
per-head mask, a position bias) goes to transformers' own sdpa unchanged.

`use_packed_attention(model)` switches a model whose attention is "sdpa" to this one; `qpalette`
loads every model with it (`QPALETTE_ATTENTION=sdpa` opts out; `qpalette bench --attention sdpa`
times transformers' own for comparison).

It also gives Llama-style attention modules a forward (`install_rope_attention`) that, for one new
token against a static cache, hands the q/k/v projections as they are to one kernel that applies
rope, writes the cache and attends (`qpalette::rope_cache_attention`): transformers' forward runs rope
and the cache update (two copies) as three more kernels a layer.
"""

from __future__ import annotations

import functools
import os
import types

import torch

NAME = "qpalette_sdpa"


def packed_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, Q, D) query, (B, KV, L, D) cache →
    ((B, Q, H, D) output, no weights)."""
    b, heads, q_len, dim = query.shape
    length = key.shape[2]
    mask = attention_mask
    shared = mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[3] == length)
    plain = (kwargs.get("softcap") is None and kwargs.get("position_bias") is None
             and not kwargs.get("output_attentions", False) and dropout == 0.0)
    # one query row per sequence; keys and values of one shape (not MLA's wider keys), one batch
    same_shape = value.shape == key.shape and key.shape[0] == b and key.shape[-1] == dim
    if q_len != 1 or not shared or not plain or not same_shape or heads % key.shape[1]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    from qpalette.runtime.decode_attention import decode_attention

    out = decode_attention(query[:, :, 0], key, value, None if mask is None else mask[:, 0, 0],
                           scaling if scaling is not None else dim ** -0.5)
    return out.reshape(b, 1, heads, dim), None


def register() -> None:
    """Make NAME a transformers attention implementation (masks built as for sdpa). Idempotent.
    (transformers is imported here, not at the top: `import transformers` runs qpalette's
    registration hook, which imports this module.)"""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_packed_attention(model) -> bool:
    """Switch `model` from transformers' sdpa to the packed decode attention; True if it did.
    Other implementations (eager, flash, flex) are the user's choice and stay, and
    `QPALETTE_ATTENTION=sdpa` keeps transformers' sdpa (transformers' continuous batching,
    `generate_batch`, accepts only its own implementations)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or os.environ.get("QPALETTE_ATTENTION") == "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        return False
    for module in model.modules():
        install_rope_attention(module)
    return True


def use_transformers_attention(model) -> None:
    """Back to transformers' own sdpa (what `qpalette bench --attention sdpa` times)."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")
    for module in model.modules():
        remove_rope_attention(module)


# ---- rope, cache update and attention in one kernel ----------------------------------------------
# attention classes whose forward is Llama's: q/k/v projections, apply_rotary_pos_emb, cache.update,
# the attention function, o_proj (Mistral and Qwen2 differ only in passing `sliding_window` to the
# attention function, which this attention, like the packed one, leaves to the mask)
ROPE_ATTENTION = (("llama", "LlamaAttention"), ("mistral", "MistralAttention"), ("qwen2", "Qwen2Attention"))


@functools.cache
def _rope_attention_forwards() -> frozenset:
    from qpalette.runtime.modules import forward_codes

    return forward_codes(ROPE_ATTENTION)


def install_rope_attention(module: torch.nn.Module) -> bool:
    """Give an attention module of a ROPE_ATTENTION class (by its forward's code) the one-kernel
    decode forward; True if it did. QPALETTE_FUSED_ATTENTION=0 (read when a model is loaded) keeps
    transformers' forward."""
    from qpalette.runtime.modules import forward_code

    if (os.environ.get("QPALETTE_FUSED_ATTENTION", "1") == "0"
            or not all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            or forward_code(type(module).forward) not in _rope_attention_forwards()):
        return False
    module.forward = types.MethodType(_rope_attention_forward, module)
    return True


def remove_rope_attention(module: torch.nn.Module) -> None:
    from qpalette.runtime.modules import uninstall_forward

    uninstall_forward(module, _rope_attention_forward)


def rope_attention_count(model: torch.nn.Module) -> int:
    """Attention modules of `model` with the one-kernel decode forward."""
    from qpalette.runtime.modules import installed_forward

    return sum(1 for m in model.modules() if installed_forward(m, _rope_attention_forward))


def _rope_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                            *args, **kwargs):
    where = _cache_slot(self, hidden_states, position_embeddings, attention_mask, args, kwargs)
    if where is None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    from qpalette.runtime.decode_attention import rope_cache_attention

    keys, values, slot, static_layers, mask = where
    b = hidden_states.shape[0]
    cos, sin = position_embeddings
    rows = [proj(hidden_states)[:, 0] for proj in (self.q_proj, self.k_proj, self.v_proj)]  # (B, width) views
    out = rope_cache_attention(*rows, cos[:, 0], sin[:, 0], keys, values, slot, mask, self.scaling)
    if static_layers is not None:
        _advance(self.layer_idx, static_layers)
    return self.o_proj(out.reshape(b, 1, -1)), None


def _advance(layer_idx: int, layers) -> None:
    """A StaticLayer's length advances after its attention, as transformers' update does. Where every
    layer of the cache is an initialized StaticLayer of one size, _cache_slot's conditions hold for all
    layers of the call or for none, so the last layer advances them all at once: compiled on CUDA, one
    foreach kernel a step where one kernel a layer ran (~0.9 µs each, 32 a Llama-3.1-8B step)."""
    from transformers.cache_utils import StaticLayer

    size = layers[0].max_cache_len
    if not all(type(layer) is StaticLayer and layer.is_initialized and layer.max_cache_len == size for layer in layers):
        layers[layer_idx].cumulative_length.add_(1)
    elif layer_idx == len(layers) - 1:
        torch._foreach_add_([layer.cumulative_length for layer in layers], 1)


def on_kernels(x: torch.Tensor) -> bool:
    """Whether the one-kernel forward serves activations like x (CUDA; elsewhere transformers' forward)."""
    return x.is_cuda


def _cache_slot(attn, x, position_embeddings, attention_mask, args, kwargs):
    """(keys, values, slot, the cache's layers or None, mask rows) when this call is one new token a row
    against a static cache that the kernel can write (qpalette's decoder's SlotKVCache at its `write_at`
    slot, or a transformers StaticLayer at its length, which then advances by one: `_advance`, given the
    cache's layers; None for a SlotKVCache), with this attention implementation, no gradient and no
    option the kernel lacks; else None (transformers' forward)."""
    from qpalette.generation.decoder import SlotKVCache

    if (args or position_embeddings is None or x.dim() != 3 or x.shape[1] != 1 or not on_kernels(x)
            or attn.config._attn_implementation != NAME or torch.is_grad_enabled()
            or kwargs.get("output_attentions") or (attn.training and attn.attention_dropout > 0)):
        return None
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    idx = attn.layer_idx
    if isinstance(cache, SlotKVCache):
        if (idx not in cache.keys or cache.write_at is None or cache.write_at.numel() != 1
                or cache.write_at.device != cache.keys[idx].device):  # a model split over GPUs: its update moves it
            return None
        keys, values, slot, static_layers = cache.keys[idx], cache.values[idx], cache.write_at, None
    else:
        from transformers.cache_utils import StaticLayer

        layers = getattr(cache, "layers", None)
        layer = layers[idx] if layers is not None and idx < len(layers) else None
        if (type(layer) is not StaticLayer or not layer.is_initialized
                or getattr(cache, "offloading", False)):
            return None
        keys, values, slot, static_layers = layer.keys, layer.values, layer.cumulative_length, layers
    mask = attention_mask
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != keys.shape[2]:
            return None
        mask = mask[:, 0, 0]
    return keys, values, slot, static_layers, mask
