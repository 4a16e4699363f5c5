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
"""

from __future__ import annotations

import os

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
    return model.config._attn_implementation == NAME


def use_transformers_attention(model) -> None:
    """Back to transformers' own sdpa (what `qpalette bench --attention sdpa` times)."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")
