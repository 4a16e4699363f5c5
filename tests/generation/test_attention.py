"""The packed decode attention (qpalette.generation.attention) against transformers' sdpa."""

from __future__ import annotations

import pytest
import torch

from qpalette.generation.attention import NAME, use_packed_attention, use_transformers_attention


def _load(path, device="cpu", dtype=torch.float32, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()


def _decode_logits(model, steps: int = 4, batch: int = 2, prompt: int = 5, compiled: bool = False,
                   tokens: torch.Tensor | None = None):
    """Logits of `steps` greedy decode steps after a prefill, against a static cache; `tokens`
    (batch, steps): feed these instead of the greedy picks."""
    from qpalette.measure.bench import random_prompt, static_cache

    cache = static_cache(model.config, batch, prompt + steps, model.device, model.dtype)
    pos = torch.arange(prompt + steps, device=model.device)
    ids = random_prompt(model, batch, prompt, seed=1)
    from qpalette.models.walk import cache_kwarg

    forward = torch.compile(model.forward) if compiled else model.forward
    out, kw = [], {cache_kwarg(model): cache}
    with torch.no_grad():
        logits = model(input_ids=ids, cache_position=pos[:prompt], position_ids=pos[None, :prompt], **kw).logits
        for i in range(prompt, prompt + steps):
            token = logits[:, -1:].argmax(-1) if tokens is None else tokens[:, i - prompt:i - prompt + 1]
            logits = forward(input_ids=token, cache_position=pos[i:i + 1], position_ids=pos[None, i:i + 1],
                             **kw).logits
            out.append(logits[:, -1])
    return torch.stack(out, 1)


@pytest.fixture
def sdpa_queries(monkeypatch):
    """The query shapes SDPA is called with."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, *args, **kw):
        seen.append(tuple(q.shape))
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


@pytest.fixture
def decode_calls(monkeypatch):
    """(query, key) shapes qpalette::decode_attention runs (its CPU implementation)."""
    from qpalette.runtime import decode_attention as da

    seen, reference = [], da.reference

    def recording(q, k, *args):
        seen.append((tuple(q.shape), tuple(k.shape)))
        return reference(q, k, *args)

    monkeypatch.setattr(da, "reference", recording)
    return seen


def test_packed_decode_equals_transformers_sdpa(tiny_llama_dir, sdpa_queries, decode_calls):
    """Same logits at every decode step; decode runs qpalette::decode_attention on the cache as it
    is (tiny Llama: 4 heads over 2 KV heads, head dim 16), the prefill transformers' sdpa."""
    model = _load(tiny_llama_dir)
    theirs = _decode_logits(model)
    assert use_packed_attention(model) and model.config._attn_implementation == NAME
    sdpa_queries.clear()
    mine = _decode_logits(model)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert decode_calls == [((2, 4, 16), (2, 2, 9, 16))] * (4 * 2)  # 4 steps × 2 blocks, cache of 5 + 4
    assert sdpa_queries == [(2, 4, 5, 16)] * 2  # the prefill, each block
    use_transformers_attention(model)
    assert model.config._attn_implementation == "sdpa"


def test_decoder_with_left_padding_same_tokens(tiny_llama_dir):
    """qpalette's decoder (its own padded 4-D mask) picks the same tokens with either attention."""
    from qpalette.generation import Decoder, SamplingOptions

    model = _load(tiny_llama_dir)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41], [100]]
    theirs = Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens
    assert use_packed_attention(model)
    assert Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens == theirs


def test_only_sdpa_models_switch(tiny_llama_dir, tmp_path, decode_calls):
    """eager stays eager; a model without grouped heads (G = 1) decodes the same through the op."""
    from tests.tiny_llama import make_tiny_llama

    assert not use_packed_attention(_load(tiny_llama_dir, attn="eager"))
    mha = _load(make_tiny_llama(tmp_path / "mha", num_key_value_heads=4))
    theirs = _decode_logits(mha, steps=2)
    assert use_packed_attention(mha)
    torch.testing.assert_close(_decode_logits(mha, steps=2), theirs)
    assert decode_calls and all(k[1] == 4 for _, k in decode_calls)


def test_qpalette_loads_with_packed_attention(tiny_llama_dir, tmp_path):
    """qpalette's loader (any model) and transformers' from_pretrained of a qpalette checkpoint."""
    from helpers import run_compress
    from transformers import AutoModelForCausalLM

    from qpalette.runtime.loading import load_model

    assert load_model(tiny_llama_dir, "cpu", tokenizer=False)[0].config._attn_implementation == NAME
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "q").config._attn_implementation == NAME


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_sliding_window_models_with_left_padding(tmp_path, model_type, decode_calls):
    """Mistral / Qwen2 configured with a sliding window shorter than the prompt: qpalette's decoder
    (its own padded mask) and transformers' generate (the mask transformers builds, window
    included) give the same tokens with either attention."""
    from qpalette.generation import Decoder, SamplingOptions
    from tests.tiny_llama import make_tiny_llama

    extra = {"use_sliding_window": True} if model_type == "qwen2" else {}
    model = _load(make_tiny_llama(tmp_path / model_type, model_type=model_type, sliding_window=4, **extra))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
    theirs = Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens
    theirs_hf = model.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert use_packed_attention(model)
    assert Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens == theirs
    assert torch.equal(model.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False, pad_token_id=0),
                       theirs_hf)
    assert decode_calls


def test_dynamic_cache_generate_without_a_mask(tiny_llama_dir, decode_calls):
    """transformers' own generate (dynamic cache, no padding: no mask at decode) decodes the same."""
    model = _load(tiny_llama_dir)
    ids = torch.tensor([[3, 4, 5, 6]])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    theirs = model.generate(ids, **kw)
    assert use_packed_attention(model)
    assert torch.equal(model.generate(ids, **kw), theirs) and len(decode_calls) == 4 * 2


class _Heads(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


@pytest.mark.parametrize("case", ["wider keys (MLA)", "longer mask", "one query row for a batch"])
def test_shapes_the_op_does_not_take_go_to_transformers(case, decode_calls):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from qpalette.generation.attention import packed_gqa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    if case == "wider keys (MLA)":
        q, k = torch.randn(2, 4, 1, 24, generator=g), torch.randn(2, 2, 7, 24, generator=g)
    elif case == "longer mask":
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[..., -2:] = False  # a mask over 9 keys for a 7-key cache
    else:
        q, mask = q[:1], mask[:1]
    if case == "longer mask":
        with pytest.raises(RuntimeError):  # transformers' sdpa refuses it, and so do we
            packed_gqa_attention(_Heads(), q, k, v, mask, scaling=0.25)
    else:
        out, _ = packed_gqa_attention(_Heads(), q, k, v, mask, scaling=0.25)
        torch.testing.assert_close(out, sdpa_attention_forward(_Heads(), q, k, v, mask, scaling=0.25)[0])
    assert decode_calls == []


def test_opt_out(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("QPALETTE_ATTENTION", "sdpa")
    model = _load(tiny_llama_dir)
    assert not use_packed_attention(model) and model.config._attn_implementation == "sdpa"


@pytest.mark.gpu
def test_packed_decode_compiled_on_gpu(tmp_path, monkeypatch):
    """fp16 on CUDA, compiled as the decode loop is, head dim 64 (the kernel's): the packed
    attention against transformers', both measured against the fp32 model on the same tokens
    (the two fp16 paths round differently, so they differ by an ulp of the logits here and there:
    ours must be as close to fp32 as theirs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from qpalette.runtime import decode_attention as da
    from tests.tiny_llama import make_tiny_llama

    path = make_tiny_llama(tmp_path / "d64", hidden_size=256, head_dim=64)
    exact32 = _load(path, "cuda", torch.float32)
    feed = torch.randint(exact32.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3)).cuda()
    exact = _decode_logits(exact32, tokens=feed)
    model = _load(path, "cuda", torch.float16)
    torch._dynamo.reset()
    theirs = _decode_logits(model, compiled=True, tokens=feed).float()
    used, applies = [], da.kernel_applies
    monkeypatch.setattr(da, "kernel_applies", lambda *a: used.append(applies(*a)) or used[-1])
    roped, rope_applies = [], da.rope_kernel_applies
    monkeypatch.setattr(da, "rope_kernel_applies", lambda *a: roped.append(rope_applies(*a)) or roped[-1])
    for fused in ("0", "1"):  # the packed attention alone, then with rope and the cache update in it
        monkeypatch.setenv("QPALETTE_FUSED_ATTENTION", fused)
        use_packed_attention(model)
        torch._dynamo.reset()
        mine = _decode_logits(model, compiled=True, tokens=feed).float()
        err_mine, err_theirs = (mine - exact).abs().max().item(), (theirs - exact).abs().max().item()
        assert err_mine <= 1.5 * err_theirs + 1e-3, (fused, err_mine, err_theirs)
        assert used and all(used)
        assert (len(roped) > 0) == (fused == "1") and all(roped)
        use_transformers_attention(model)


# ---- the one-kernel decode forward (rope, cache update and attention in one op) ------------------

@pytest.fixture
def rope_calls(monkeypatch):
    """Batch sizes qpalette::rope_cache_attention runs (its reference), with the one-kernel forward
    let onto CPU activations."""
    from qpalette.generation import attention
    from qpalette.runtime import decode_attention as da

    seen, reference = [], da.rope_cache_reference

    def recording(q, *args):
        seen.append(q.shape[0])
        return reference(q, *args)

    monkeypatch.setattr(attention, "on_kernels", lambda x: True)
    monkeypatch.setattr(da, "rope_cache_reference", recording)
    return seen


def test_rope_attention_equals_transformers_on_a_static_cache(tiny_llama_dir, rope_calls):
    """Same logits at every step of a StaticCache decode (transformers' cache: the op advances the
    layer's length, so transformers' own updates after it still land right), eager and compiled."""
    from qpalette.generation.attention import rope_attention_count

    model = _load(tiny_llama_dir)
    theirs = _decode_logits(model)
    assert use_packed_attention(model) and rope_attention_count(model) == 2
    torch.testing.assert_close(_decode_logits(model), theirs, rtol=1e-5, atol=1e-5)
    assert rope_calls == [2] * (4 * 2)
    torch._dynamo.reset()
    torch.testing.assert_close(_decode_logits(model, compiled=True), theirs, rtol=1e-5, atol=1e-5)
    use_transformers_attention(model)
    assert rope_attention_count(model) == 0


def test_compiled_layers_share_one_cos_sin_and_mask(tmp_path, rope_calls):
    """Compiled, every layer's rope_cache_attention reads the same cos, sin and mask buffers: one
    kernel a step computes them (without the op's flexible_layout tag inductor made a copy for
    each layer: a mask kernel a layer, 32 a step on Llama-3.1-8B)."""
    import re

    from tiny_llama import make_tiny_llama
    from torch._inductor.utils import run_and_get_code

    model = _load(make_tiny_llama(tmp_path, num_hidden_layers=4))
    assert use_packed_attention(model)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would not show the code
        _, codes = run_and_get_code(lambda: _decode_logits(model, steps=2, batch=1, compiled=True))
    calls = [c for code in codes for c in re.findall(r"torch\.ops\.qpalette\.rope_cache_attention\.default\((.*)\)",
                                                      code)]
    names = [re.findall(r"\b(?:buf|arg)\w+", c) for c in calls]  # tensor arguments in order
    assert len(names) == 4 and all(len(n) == 9 for n in names)
    for i in (3, 4, 8):  # cos, sin, mask
        assert len({n[i] for n in names}) == 1, [n[i] for n in names]


def test_rope_attention_in_the_decoder_with_left_padding(tiny_llama_dir, rope_calls):
    """qpalette's decoder (its SlotKVCache, written at `write_at`) picks the same tokens."""
    from qpalette.generation import Decoder, SamplingOptions

    model = _load(tiny_llama_dir)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41], [100]]
    theirs = Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens
    assert use_packed_attention(model)
    assert Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens == theirs
    assert rope_calls and set(rope_calls) == {4}  # batch bucket 4, decode steps only


def test_rope_attention_leaves_other_calls_to_transformers(tiny_llama_dir, rope_calls, monkeypatch):
    """Prefill, transformers' dynamic cache, gradients and QPALETTE_FUSED_ATTENTION=0 do not use it."""
    model = _load(tiny_llama_dir)
    assert use_packed_attention(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)  # dynamic cache
    model(input_ids=ids)
    assert rope_calls == []
    monkeypatch.setenv("QPALETTE_FUSED_ATTENTION", "0")
    from qpalette.generation.attention import rope_attention_count

    assert use_packed_attention(_load(tiny_llama_dir)) and rope_attention_count(_load(tiny_llama_dir)) == 0


@pytest.mark.gpu
def test_rope_attention_in_the_fused_blocks_of_a_quantized_model(tmp_path):
    """A tcq-2.0 checkpoint on CUDA (batch 1: blocks fused into their GEMVs, hidden 256, head dim 64)
    decoding against a StaticCache, eager and compiled, and through qpalette's decoder: the one-kernel
    attention gives transformers' attention forward's logits and tokens within fp16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from helpers import run_compress

    from qpalette.generation import Decoder, SamplingOptions
    from qpalette.generation.attention import (
        install_rope_attention,
        remove_rope_attention,
        rope_attention_count,
    )
    from qpalette.runtime.loading import load_model
    from qpalette.runtime.modules import fused_block_count
    from tests.tiny_llama import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2)
    run_compress(src, tmp_path / "q", scheme="tcq-2.0")
    model, _ = load_model(tmp_path / "q", "cuda", torch.float16, tokenizer=False)
    layers = len(model.model.layers)
    assert rope_attention_count(model) == layers and fused_block_count(model) == layers
    feed = torch.randint(model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(5)).cuda()
    prompts = [[5, 6, 7, 8, 9, 10]]
    results = {}
    for fused in (True, False):
        for m in model.modules():
            install_rope_attention(m) if fused else remove_rope_attention(m)
        torch._dynamo.reset()
        results[fused] = (_decode_logits(model, batch=1, tokens=feed).float(),
                          _decode_logits(model, batch=1, tokens=feed, compiled=True).float(),
                          Decoder(model).generate_ids(prompts, 6, SamplingOptions(), stop_at_eos=False).tokens)
    for mine, theirs in zip(results[True][:2], results[False][:2]):
        assert ((mine - theirs).norm() / theirs.norm()).item() < 1e-2
    assert results[True][2] == results[False][2]


def test_static_lengths_advance_once_after_the_last_layer():
    """A cache of StaticLayers of one size advances every layer's length at the last layer's call
    (one foreach); any other cache advances each layer's own length at its call."""
    from transformers.cache_utils import StaticLayer

    from qpalette.generation.attention import _advance

    def layers(*sizes):
        made = []
        for size in sizes:
            layer = StaticLayer(max_cache_len=size)
            layer.lazy_initialization(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
            layer.cumulative_length.fill_(5)
            made.append(layer)
        return made

    def lengths(made):
        return [int(layer.cumulative_length) for layer in made]

    same = layers(9, 9, 9)
    for i in range(2):
        _advance(i, same)
        assert lengths(same) == [5, 5, 5]
    _advance(2, same)
    assert lengths(same) == [6, 6, 6]
    mixed = layers(9, 9, 16)
    _advance(0, mixed)
    assert lengths(mixed) == [6, 5, 5]
