"""qpalette.models.synthetic: a random-weight checkpoint that transformers loads as is."""

from __future__ import annotations

import json
import math

import pytest
import torch

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 4, "vocab_size": 320, "tie_word_embeddings": False,
        "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def syn():
    from qpalette.models import synthetic

    return synthetic


@pytest.fixture()
def tiny_config(tmp_path):
    p = tmp_path / "tiny_config.json"
    p.write_text(json.dumps(TINY))
    return p


def test_tiny_checkpoint_loads_in_transformers(syn, tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = syn.make_synthetic_model(tmp_path / "m1", str(tiny_config), layers=1, seed=5,
                                   shard_gb=0.0005, log=lambda m: None)  # 0.5 MB shards: several
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "m1.partial").exists()
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg = model.config
    assert cfg.num_hidden_layers == 1 and cfg.hidden_size == 256 and len(model.model.layers) == 1
    assert model.dtype == torch.float16  # the checkpoint's dtype
    sd = model.state_dict()
    assert index["metadata"]["total_size"] == sum(2 * t.numel() for t in sd.values())
    w = sd["model.layers.0.mlp.down_proj.weight"].float()
    assert w.shape == (256, 512) and abs(float(w.std()) - 0.02) < 0.001 and abs(float(w.mean())) < 0.001
    assert bool((sd["model.layers.0.input_layernorm.weight"] == 1).all())
    assert not torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.k_proj.weight"][:1])
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.bos_token_id == cfg.bos_token_id == 256
    ids = tok("hello synthetic", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.float()(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 320) and bool(torch.isfinite(logits).all())

    # per-tensor seeds: the first block of a 2-block model is the 1-block model's
    from safetensors.torch import load_file

    out2 = syn.make_synthetic_model(tmp_path / "m2", str(tiny_config), layers=2, seed=5, log=lambda m: None)
    two = load_file(out2 / "model.safetensors")  # one shard at the default 2 GB
    assert torch.equal(two["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.q_proj.weight"])
    assert "model.layers.1.mlp.up_proj.weight" in two


def test_llama31_8b_layout_and_cli(syn, tiny_config, tmp_path, capsys):
    # the 8B shapes, planned only (meta tensors; 2 blocks here, the 32-block size from them)
    d = syn.load_config_dict("llama-3.1-8b")[0]
    assert syn.build_config(d, layers=None).num_hidden_layers == 32
    cfg = syn.build_config(d, layers=2)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads, cfg.vocab_size) == (4096, 14336, 8, 128256)
    assert cfg.rope_parameters["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    specs = dict(syn.tensor_specs(cfg))
    assert specs["model.layers.1.self_attn.k_proj.weight"] == (1024, 4096)
    assert specs["model.layers.1.mlp.down_proj.weight"] == (4096, 14336)
    block = sum(2 * math.prod(s) for n, s in specs.items() if n.startswith("model.layers.1."))
    rest = sum(2 * math.prod(s) for n, s in specs.items() if not n.startswith("model.layers."))
    assert rest + 32 * block == 16_060_522_496  # Llama-3.1-8B in float16
    shards = syn.plan_shards(list(specs.items()), int(2e9))
    sizes = [sum(2 * math.prod(s) for _n, s in sh) for sh in shards]
    assert max(sizes) <= 2e9 and [n for sh in shards for n, _s in sh] == list(specs)  # model order

    # the command line: user errors → exit 2 with a message, refusing to overwrite
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for args, msg in [([str(tmp_path / "full"), "--config", str(tiny_config)], "not empty"),
                      ([str(tmp_path / "o"), "--config", "no-such-model"], "known name"),
                      ([str(tmp_path / "o"), "--config", str(tiny_config), "--layers", "0"], "--layers")]:
        assert syn.main(args) == 2, args
        assert msg in capsys.readouterr().err
    assert syn.main([str(tmp_path / "o"), "--config", str(tiny_config), "--layers", "1"]) == 0
    assert (tmp_path / "o" / "model.safetensors").is_file() and (tmp_path / "o" / "tokenizer.json").is_file()
    assert syn.main([str(tmp_path / "o"), "--config", str(tiny_config), "--layers", "2", "--force"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["num_hidden_layers"] == 2


def test_moe_checkpoint_stores_one_matrix_per_expert_and_compresses(syn, tmp_path):
    """The shipped Qwen3-30B-A3B shapes, scaled down: per-expert tensors as the published checkpoints
    store them, which transformers loads into its fused experts and qpalette compresses."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import qpalette

    cfg, _ = syn.load_config_dict("qwen3-moe")
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (128, 8, 768)
    cfg.update(hidden_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, vocab_size=320, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, bos_token_id=None, eos_token_id=None)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = syn.make_synthetic_model(tmp_path / "m", str(tmp_path / "c.json"), layers=1, log=lambda m: None)
    stored = load_file(out / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (256, 128)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj[3], stored["model.layers.0.mlp.experts.3.down_proj.weight"])
    qpalette.compress(str(out), "nuq-4", tmp_path / "q", quiet=True)
    q, _ = qpalette.load_model(tmp_path / "q", tokenizer=False)
    assert "model.layers.0.mlp.experts.3.down_proj" in q.config.quantization_config.layers
