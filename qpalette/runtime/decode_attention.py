"""`qpalette::decode_attention`: attention of one query token over a grouped-query KV cache.

out[b, h] = softmax(scale · q[b, h] · K[b, h // G]ᵀ + mask[b]) · V[b, h // G], G = H / KV.
A torch.library custom op with a fake implementation (torch.compile and CUDA graphs see an ordinary
op), the pure-PyTorch reference on every device, and on CUDA the split-length kernel of
runtime/cuda/decode_attention.cu where it applies (float16/bfloat16, head dim 64 or 128, G ≤ 8, a
contiguous cache); elsewhere SDPA on the packed heads. generation/attention.py calls it at decode.

`qpalette::rope_cache_attention` is the same attention for the new token's projections as the q/k/v
GEMVs wrote them: rope on q and on the new key, the key and value written to the caches at a slot
and the attention, all in one kernel, where transformers runs rope and two cache copies as separate
kernels
(`generation.attention.install_rope_attention` calls it).
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from qpalette.errors import KernelError
from qpalette.runtime import kernel_build
from qpalette.runtime.ops import KERNEL_DTYPES, _num_sms, _pdl_on, _stream

KERNEL_HEAD_DIMS = (64, 128)
KERNEL_MAX_GROUPS = 8
KERNEL_MAX_GRID_Y = 65535  # batch × KV heads: one CTA row each


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              scale: float) -> torch.Tensor:
    """q (B, H, D), k and v (B, KV, L, D), mask (B or 1, L) bool (True: seen) or additive → (B, H, D),
    in float32; a query that sees no key gets zeros."""
    b, h, d = q.shape
    kv = k.shape[1]
    qg = q.float().reshape(b, kv, h // kv, d)
    scores = scale * qg @ k.float().transpose(-1, -2)  # (B, KV, G, L)
    if mask is not None:
        bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, device=mask.device).masked_fill(
            ~mask, float("-inf"))
        scores = scores + bias.float()[:, None, None, :]
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return (weights @ v.float()).reshape(b, h, d).to(q.dtype)


def kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether the CUDA kernel takes these inputs (else SDPA runs them)."""
    b, h, d = q.shape
    kv = k.shape[1]
    return (q.is_cuda and q.dtype in KERNEL_DTYPES and k.dtype == q.dtype == v.dtype and d in KERNEL_HEAD_DIMS
            and k.shape == v.shape and h % kv == 0 and h // kv <= KERNEL_MAX_GROUPS and b * kv <= KERNEL_MAX_GRID_Y
            and k.is_contiguous() and v.is_contiguous() and (mask is None or mask.dtype in (torch.bool, q.dtype))
            and _kernels_built(q.device))


_build_failed: set[int] = set()


def _kernels_built(device: torch.device) -> bool:
    """Whether the kernels are on and built. Unlike a quantized layer, attention has a good
    fallback (SDPA), so an FP16 model on a machine without nvcc still decodes: one warning, and
    the failed build is not retried on every layer of every token."""
    index = device.index if device.index is not None else -1
    if index in _build_failed:
        return False
    try:
        return kernel_build.available(device)
    except KernelError as e:
        _build_failed.add(index)
        _warn_once(str(e))
        return False


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    warnings.warn(f"qpalette decode attention runs SDPA instead of its kernel: {reason}", stacklevel=3)


@torch.library.custom_op("qpalette::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    return reference(q, k, v, mask, scale)


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(q, k, v, mask, scale):
    if not kernel_applies(q, k, v, mask):
        return packed_sdpa(q, k, v, mask, scale)
    dev = q.device
    with torch.cuda.device(dev):
        return kernel_build.extension(dev).decode_attention(
            q.contiguous(), k, v, _mask_rows(mask), scale, _stream(dev), _num_sms(dev),
            _pdl_on(dev))


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _mask_rows(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask as the kernel reads it: rows with unit stride, any batch stride. transformers' sdpa
    mask is one row expanded over the batch (stride 0); `.contiguous()` of it was a copy kernel a
    layer of every decode step at batch > 1."""
    if mask is None or mask.stride(-1) == 1 or mask.shape[-1] == 1:
        return mask
    return mask.contiguous()


def packed_sdpa(q, k, v, mask, scale):
    """SDPA with the G query heads of a KV head as G query rows (no copy of the cache)."""
    b, h, d = q.shape
    kv = k.shape[1]
    attn_mask = None if mask is None else mask[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v,
                                                           attn_mask=attn_mask, scale=scale)
    return out.reshape(b, h, d)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for x (B, N, D) and cos, sin (B or 1, D), in float32 and
    rounded once (as inductor computes it)."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos.float()[:, None] + rotated * sin.float()[:, None]).to(x.dtype)


def _rope_and_write(q, k_new, v_new, cos, sin, key_cache, value_cache, slot) -> torch.Tensor:
    """The rows (B, H·D) / (B, KV·D) roped, the new key and value written at `slot`: the roped
    queries (B, H, D)."""
    b, kv, _, d = key_cache.shape
    key_cache.index_copy_(2, slot.reshape(1), apply_rope(k_new.reshape(b, kv, d), cos, sin)[:, :, None])
    value_cache.index_copy_(2, slot.reshape(1), v_new.reshape(b, kv, 1, d))
    return apply_rope(q.reshape(b, -1, d), cos, sin)


def rope_cache_reference(q, k_new, v_new, cos, sin, key_cache, value_cache, slot, mask, scale):
    """The pure-PyTorch rope_cache_attention on every device: `_rope_and_write`, then `reference`
    attention over the caches."""
    q_rot = _rope_and_write(q, k_new, v_new, cos, sin, key_cache, value_cache, slot)
    return reference(q_rot, key_cache, value_cache, mask, scale)


def rope_kernel_applies(q, k_new, v_new, cos, sin, key_cache, value_cache, slot, mask) -> bool:
    """Whether the CUDA kernel takes these inputs (`kernel_applies`, rows with a contiguous last dim,
    16-byte aligned value rows, one int64 slot on the device); else the reference runs them."""
    b, kv, _, d = key_cache.shape
    rows = (q, k_new, v_new, cos, sin)
    return (kernel_applies(q.unflatten(1, (-1, d)), key_cache, value_cache, mask)
            and all(t.dtype == q.dtype and t.dim() == 2 and t.stride(-1) == 1 for t in rows)
            and k_new.stride(0) == v_new.stride(0) and cos.stride(0) == sin.stride(0)
            and (v_new.stride(0) * v_new.element_size()) % 16 == 0 and v_new.data_ptr() % 16 == 0
            and slot.dtype == torch.long and slot.numel() == 1 and slot.device == q.device)


# The slot is only read (a StaticCache layer's length, which the caller advances after the op): with
# the advance inside the op, a compiled Llama built its mask from the advanced length (CPU, torch 2.13).
# flexible_layout: inductor may pass cos, sin and the mask as the buffers it computed them in; with
# torch's default (exact eager strides) it computed them again for every layer (a kernel a layer).
@torch.library.custom_op("qpalette::rope_cache_attention", mutates_args=("key_cache", "value_cache"),
                         tags=(torch.Tag.flexible_layout,))
def rope_cache_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot: torch.Tensor,
                         mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """q (B, H·D), k_new and v_new (B, KV·D): one token's projections before rope; cos, sin (B or 1, D);
    caches (B, KV, L, D) written at slot (one int64); mask (B or 1, L) → (B, H, D)."""
    return rope_cache_reference(q, k_new, v_new, cos, sin, key_cache, value_cache, slot, mask, scale)


@rope_cache_attention.register_kernel("cuda")
def _rope_cache_attention_cuda(q, k_new, v_new, cos, sin, key_cache, value_cache, slot, mask, scale):
    if not rope_kernel_applies(q, k_new, v_new, cos, sin, key_cache, value_cache, slot, mask):
        # rope and the write in torch, then decode_attention's own choice (its kernel or packed SDPA),
        # not the float32 reference, which copies the whole cache to float32
        q_rot = _rope_and_write(q, k_new, v_new, cos, sin, key_cache, value_cache, slot)
        return _decode_attention_cuda(q_rot, key_cache, value_cache, mask, scale)
    dev = q.device
    with torch.cuda.device(dev):
        return kernel_build.extension(dev).rope_cache_attention(
            q, k_new, v_new, cos, sin, key_cache, value_cache, slot,
            _mask_rows(mask), scale, _stream(dev), _num_sms(dev), _pdl_on(dev))


@rope_cache_attention.register_fake
def _(q, k_new, v_new, cos, sin, key_cache, value_cache, slot, mask, scale):
    b, d = q.shape[0], key_cache.shape[-1]
    return q.new_empty(b, q.shape[1] // d, d)
