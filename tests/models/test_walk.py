"""The walk keeps what Llama-family files were made with: layer names and order, input groups,
rotation modules, sign seeds and unquantized parameter counts equal to the config formulas they
replaced (plans, checkpoints and Hessians stay byte-identical)."""

from __future__ import annotations

import pytest

from qpalette.models.topology import linear_layers, unquantized_params
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
