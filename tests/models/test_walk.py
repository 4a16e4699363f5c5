"""The walk keeps what Llama-family files were made with: layer names and order, input groups,
rotation modules, sign seeds and unquantized parameter counts equal to the config formulas they
replaced (plans, checkpoints and Hessians stay byte-identical)."""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch

from qpalette.models.topology import linear_layers, unquantized_params
from qpalette.models.walk import _cache_kwarg, cache_kwarg
from qpalette.runtime.checkpoint import sign_seed

BASE = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)
KINDS = ("q", "k", "v", "o", "gate", "up", "down")


def formula_params(cfg: dict, mt: str) -> dict[str, int]:
    """The parameter counts config.json alone gave before the walk (Llama, Mistral, Qwen2, Qwen3)."""
    h, n, v, i = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"embed_tokens": v * h}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head"] = v * h
    out["norms"] = (2 * n + 1) * h
    if mt == "qwen3":
        out["qk_norms"] = 2 * n * hd
    if cfg.get("attention_bias", mt == "qwen2"):
        out["attention_bias"] = n * (q_out + 2 * kv_out) + (n * h if mt != "qwen2" else 0)
    if cfg.get("mlp_bias"):
        out["mlp_bias"] = n * (2 * i + h)
    return out


@pytest.mark.parametrize("mt,extra", [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("mistral", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32}),
])
def test_llama_family_layers_are_as_before(mt, extra):
    cfg = BASE | extra | {"model_type": mt}
    layers = linear_layers(cfg, lm_head=True)
    part = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn"}
    assert [l.name for l in layers] == [
        f"model.layers.{b}.{part.get(k, 'mlp')}.{k}_proj" for b in range(3) for k in KINDS] + ["lm_head"]
    group = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gateup", "up": "gateup"}
    rotation = {"qkv": "rotate_qkv", "o": "rotate_o", "gateup": "rotate_gate_up", "down": "rotate_down"}
    for l in layers[:-1]:
        assert l.input_group == group.get(l.kind, l.kind)
        assert l.rotation == f"{l.parent}.{rotation[l.input_group]}"
    assert (layers[-1].input_group, layers[-1].rotation, layers[-1].block) == ("head", "rotate_lm_head", 3)
    assert unquantized_params(cfg) == formula_params(cfg, mt)


def test_llama_sign_seeds_are_as_before():
    for b in range(3):
        for g, index in (("qkv", 0), ("o", 1), ("gateup", 2), ("down", 3), ("head", 4)):
            assert sign_seed(7, b, g) == 7 * 1_000_003 + 8 * b + index
    assert sign_seed(7, 0, "mlp.experts.0.gateup") != sign_seed(7, 0, "mlp.experts.1.gateup")


def _renaming(forward):
    """A decorator like transformers' deprecate_kwarg: a (*args, **kwargs) wrapper made with functools.wraps."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        return forward(*args, **kwargs)
    return wrapper


class _TakesCache:
    def forward(self, input_ids, cache=None, use_cache=False):
        return cache


class _TakesPast:
    def forward(self, input_ids, past_key_values=None, use_cache=False):
        return past_key_values


class _Decorated:
    @_renaming
    def forward(self, input_ids, cache=None, use_cache=False):
        return cache


class _Opaque:  # a wrapper that hides the signature: the old name, which every version takes through **kwargs
    forward = staticmethod(lambda *args, **kwargs: None)


class _SubOfCache(_TakesCache):
    pass


def test_cache_kwarg_follows_the_forward_signature():
    assert cache_kwarg(_TakesCache()) == "cache"
    assert cache_kwarg(_TakesPast()) == "past_key_values"
    assert cache_kwarg(_Decorated()) == "cache"
    assert list(inspect.signature(_Decorated.forward, follow_wrapped=False).parameters) == ["args", "kwargs"]
    assert cache_kwarg(_Opaque()) == "past_key_values"
    assert cache_kwarg(_SubOfCache()) == "cache"
    assert cache_kwarg(object()) == "past_key_values"  # no forward at all
    hits = _cache_kwarg.cache_info().hits
    assert cache_kwarg(_TakesPast()) == "past_key_values"
    assert _cache_kwarg.cache_info().hits == hits + 1  # once per class


def test_no_deprecated_cache_keyword_reaches_the_model(tiny_llama_dir):
    """Every forward qpalette calls with a KV cache gets it by the name the installed transformers
    takes (`cache` from 5.24, which warns on every call given `past_key_values`; older ones take only
    `past_key_values`): the decoder, bench's loop, data-free calibration's sampling and the
    recorder of block arguments."""
    from transformers import AutoModelForCausalLM

    from qpalette.calibration.data import sample_tokens
    from qpalette.calibration.evaluator import block_input
    from qpalette.generation import Decoder, SamplingOptions
    from qpalette.measure.bench import DecodeLoop

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    kw = cache_kwarg(model)
    assert kw in inspect.signature(inspect.unwrap(type(model).forward)).parameters
    ids = torch.tensor([[5, 6, 7, 8]])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        out = Decoder(model).generate_ids([[5, 6, 7], [9]], 4, SamplingOptions(), stop_at_eos=False)
        assert [len(t) for t in out.tokens] == [4, 4]
        loop = DecodeLoop(model, batch=1, prompt_len=3, steps=3)
        for _ in range(3):
            loop.step()
        assert loop.pos == 6
        assert sample_tokens(model, 2, 5, seed=0, batch=2, bos_id=1, device="cpu").shape == (2, 5)
        _, kws = block_input(model, ids)
        assert all(not {"cache", "past_key_values"} & k.keys() for k in kws)
    if kw == "cache":  # the check above would catch the old name
        with pytest.warns(FutureWarning, match="past_key_values"), torch.no_grad():
            model(input_ids=ids, past_key_values=None, use_cache=True)
