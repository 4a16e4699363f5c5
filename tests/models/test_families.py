"""Each supported family, tiny random models built from its transformers config class: layers found
by walking and tracing, compress → load → logits equal to the simulated quantization, a few
generated tokens, a bit-exact save_pretrained round trip; MoE experts quantized one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_compress
from safetensors import safe_open
from tiny_llama import make_tiny_llama

import qpalette
from qpalette.errors import CompressError
from qpalette.models.experts import ExpertMLP, PerExpertMLP, unfuse_experts
from qpalette.models.topology import checkpoint_model_type, linear_layers, load_config, unquantized_params
from qpalette.runtime.checkpoint import simulated_weights

#: model_type → config overrides of make_tiny_llama's (2 blocks, hidden 64, MLP 128, 4 heads, 2 kv)
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 4},  # 16-token inputs: sliding and global blocks differ
    "gemma3_text": {"head_dim": 16, "sliding_window": 4},
    "phi3": {"pad_token_id": 0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16,
                  "mlp_only_layers": [1]},  # block 1 a dense MLP
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,  # + a shared expert
                  "shared_expert_intermediate_size": 128},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, source folder, compressed folder with nuq-4)."""
    mt = request.param
    root = tmp_path_factory.mktemp(mt)
    src = make_tiny_llama(root / "src", model_type=mt, **FAMILIES[mt])
    run_compress(src, root / "q", scheme="nuq-4")
    return mt, src, root / "q"


def original(src) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return unfuse_experts(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval())


def simulated_model(src, qmodel):
    """The original architecture (experts split) holding the dequantized weights, every other
    tensor rounded to 16 bits as stored, in float32."""
    sim = original(src)
    with torch.no_grad():
        for v in sim.state_dict().values():
            v.copy_(v.half().float())
        for name, w in simulated_weights(qmodel, qmodel.config.quantization_config.layout()).items():
            sim.get_submodule(name).weight.copy_(w)
    return sim


def shard_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_compress_load_generate_round_trip(family, ids, tmp_path):
    mt, src, out = family
    q, _ = qpalette.load_model(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == checkpoint_model_type(mt)
    with torch.no_grad():
        got, want = q(ids).logits, simulated_model(src, q)(ids).logits
    assert (got - want).norm() / want.norm() < 1e-4
    with torch.no_grad():
        quantization_moves_logits = original(src)(ids).logits
    assert (quantization_moves_logits - want).norm() / want.norm() > 1e-3  # the check can fail
    gen = q.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 8)
    q.save_pretrained(tmp_path / "again")
    stored, again = shard_tensors(out), shard_tensors(tmp_path / "again")
    assert set(again) == set(stored)
    for k, v in stored.items():  # float32 load: codes, scales, signs, codebooks keep their dtype and bits
        if not k.endswith((".weight", ".bias")):
            assert again[k].dtype == v.dtype and torch.equal(again[k], v), k
    reloaded, _ = qpalette.load_model(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, got)


def test_in_memory_quantize_equals_compress_then_load(family, ids):
    from transformers import AutoModelForCausalLM

    mt, src, out = family
    q = qpalette.quantize(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32), "nuq-4", device="cpu")
    loaded, _ = qpalette.load_model(out)
    got, want = q.state_dict(), loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    with torch.no_grad():
        assert torch.equal(q(ids).logits, loaded(ids).logits)


def test_stored_bytes_match_the_walk(family):
    mt, src, out = family
    rep = json.loads((out / "qpalette-compress.json").read_text())
    assert rep["bytes"]["unquantized_modules"] == 2 * sum(unquantized_params(load_config(src)).values())


def test_layers_and_input_groups():
    """Phi-3's pre-fused projections are groups of one; each expert has its own groups; Gemma's
    names are Llama's. Input groups come from the trace."""
    cfg = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2)
    phi = {l.name.removeprefix("model.layers.0."): (l.kind, l.input_group, l.out_features)
           for l in linear_layers(cfg | {"model_type": "phi3", "pad_token_id": 0})}
    assert phi == {"self_attn.o_proj": ("o", "o", 64), "self_attn.qkv_proj": ("qkv", "qkv", 128),
                   "mlp.gate_up_proj": ("gateup", "gateup", 256), "mlp.down_proj": ("down", "down", 64)}
    moe = linear_layers(cfg | {"model_type": "mixtral", "num_local_experts": 3})
    experts = [l for l in moe if ".experts." in l.name]
    assert len(experts) == 9 and len({l.input_group for l in experts}) == 6
    assert experts[0].rotation == "model.layers.0.mlp.experts.0.rotate_gate_up"
    gemma = [l.name for l in linear_layers(cfg | {"model_type": "gemma2", "head_dim": 16})]
    llama = [l.name for l in linear_layers(cfg | {"model_type": "llama"})]
    assert gemma == llama


def test_targets_and_ignore_choose_the_layers(tmp_path, ids):
    src = make_tiny_llama(tmp_path / "src", model_type="mixtral", **FAMILIES["mixtral"])
    cfg = load_config(src)
    names = [l.name for l in linear_layers(cfg, ignore=[r"\.experts\."])]
    assert names and not any(".experts." in n for n in names)
    assert [l.name for l in linear_layers(cfg, targets=[r"self_attn\.q_proj$"])] == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    rep = run_compress(src, tmp_path / "q", scheme="nuq-4", ignore=[r"\.experts\."])
    unquantized = unquantized_params(cfg, ignore=[r"\.experts\."])
    assert unquantized["unquantized_linears"] == 2 * 4 * 3 * 64 * 128  # blocks × experts × projections
    assert rep["bytes"]["unquantized_modules"] == 2 * sum(unquantized.values())
    layout = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert set(layout["layers"]) == set(names)
    stored = shard_tensors(tmp_path / "q")
    assert "model.layers.0.mlp.experts.2.down_proj.weight" in stored  # ignored: kept 16-bit
    q, _ = qpalette.load_model(tmp_path / "q")
    with torch.no_grad():
        got, want = q(ids).logits, simulated_model(src, q)(ids).logits
    assert (got - want).norm() / want.norm() < 1e-4


def test_per_expert_path_touches_only_routed_tokens():
    """An expert's layers see only the tokens routed to it: changing one expert changes exactly
    the rows that chose it (what makes an expert's sensitivity come from its own tokens)."""
    torch.manual_seed(0)
    experts = PerExpertMLP(ExpertMLP(8, 16, torch.nn.functional.silu) for _ in range(4))
    h = torch.randn(10, 8)
    idx = torch.randint(0, 4, (10, 2))
    w = torch.rand(10, 2)
    before = experts(h, idx, w)
    with torch.no_grad():
        experts[1].up_proj.weight.add_(1.0)
    changed = (experts(h, idx, w) - before).abs().sum(1) > 0
    assert torch.equal(changed, (idx == 1).any(1))


def test_unrouted_experts_have_zero_sensitivity(tmp_path):
    """Calibration runs the text through the router: with top-1 routing on one feature's sign,
    experts 2 and 3 never get a token, and their measured sensitivity is exactly zero."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama(tmp_path / "src", model_type="mixtral", num_local_experts=4, num_experts_per_tok=1)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for block in model.model.layers:
            block.post_attention_layernorm.weight.zero_()[0] = 1.0  # the router reads feature 0 alone
            block.mlp.gate.weight.zero_()[:2, 0] = torch.tensor([1.0, -1.0])  # > 0: expert 0, < 0: expert 1
    model.save_pretrained(src)
    doc = qpalette.calibrate(str(src), tmp_path / "sens.json", devices="cpu", num_seqs=2, seq_len=32, levels=2,
                             progress=False)
    a = {n: v["a"] for n, v in doc["layers"].items()}
    for e, routed in ((0, True), (1, True), (2, False), (3, False)):
        values = [a[f"model.layers.{b}.mlp.experts.{e}.{p}_proj"] for b in (0, 1) for p in ("gate", "up", "down")]
        assert all(v > 0 for v in values) if routed else all(v == 0 for v in values), (e, values)


def test_plan_gives_each_expert_its_own_entry(tmp_path):
    src = make_tiny_llama(tmp_path / "src", model_type="qwen3_moe", **FAMILIES["qwen3_moe"])
    layers = linear_layers(load_config(src))
    coeff = {l.name: (100.0 if ".experts.0." in l.name else 0.01 if ".experts." in l.name else 1.0)
             for l in layers}
    sens = tmp_path / "sens.json"
    sens.write_text(json.dumps({"format": "qpalette.sensitivity/1", "model": str(src), "protocol": "test",
                                "tokens": None, "layers": {l.name: {"a": coeff[l.name], "r2": None,
                                                                    "shape": [l.out_features, l.in_features]}
                                                           for l in layers}}))
    plan = qpalette.plan(str(src), "4bits", sensitivity=sens, output=tmp_path / "plan.json", palette=["nuq"])
    bits = {n: v.bits for n, v in plan.layers.items()}
    assert bits["model.layers.0.mlp.experts.0.down_proj"] > bits["model.layers.0.mlp.experts.1.down_proj"]
    run_compress(src, tmp_path / "q", plan=tmp_path / "plan.json")
    q, _ = qpalette.load_model(tmp_path / "q")
    assert q.config.quantization_config.layers == {n: v.quantizer for n, v in plan.layers.items()}


def test_hessians_and_data_aware_compress_on_moe(tmp_path, ids):
    """Each expert's Hessian is collected from its routed tokens; LDLQ uses it."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    src = make_tiny_llama(tmp_path / "src", model_type="mixtral", **FAMILIES["mixtral"])
    qpalette.hessians(str(src), tmp_path / "h", text_file=str(text), tokens=512, seq_len=64, device="cpu",
                      progress=False)
    run_compress(src, tmp_path / "q", scheme="vq-3.0", hessians=tmp_path / "h")
    q, _ = qpalette.load_model(tmp_path / "q")
    with torch.no_grad():
        got, want = q(ids).logits, simulated_model(src, q)(ids).logits
    assert (got - want).norm() / want.norm() < 1e-4


@pytest.mark.parametrize("cfg,says", [
    ({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 1, "n_head": 4},
     "GPT2LMHeadModel is not laid out as model.layers (decoder blocks), model.norm and lm_head"),
    ({"model_type": "gpt_oss", "vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4},
     "model.layers.0.mlp.experts.gate_up_proj (GptOssExperts, a 3-D parameter of shape [4, 64, 256]) is not a "
     "linear layer; its block layout is not understood"),
])
def test_unsupported_model_is_one_line(tmp_path, cfg, says):
    """A layout qpalette does not understand: one line naming it, exit code 2, no traceback."""
    from typer.testing import CliRunner

    from qpalette.cli import app

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["compress", str(tmp_path / "m"), "-o", str(tmp_path / "q"), "--scheme", "nuq-4"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip() and "[transformers]" not in line]
    assert len(lines) == 1 and lines[0].endswith("unsupported model: " + says), res.output


def test_a_plan_keeps_its_layer_choice(tmp_path):
    """plan --ignore records the patterns; compress with that plan selects the same layers."""
    src = make_tiny_llama(tmp_path / "src", model_type="qwen3_moe", **FAMILIES["qwen3_moe"])
    ignore = [r"\.experts\.[13]\."]
    layers = linear_layers(load_config(src), ignore=ignore)
    sens = tmp_path / "sens.json"
    sens.write_text(json.dumps({"format": "qpalette.sensitivity/1", "model": str(src), "protocol": "test",
                                "tokens": None, "layers": {l.name: {"a": 1.0, "r2": None,
                                                                    "shape": [l.out_features, l.in_features]}
                                                           for l in layers}}))
    plan = qpalette.plan(str(src), "4bits", sensitivity=sens, output=tmp_path / "plan.json", palette=["nuq"],
                         ignore=ignore)
    assert plan.options["ignore"] == ignore and set(plan.layers) == {l.name for l in layers}
    rep = run_compress(src, tmp_path / "q", plan=tmp_path / "plan.json")
    assert rep["bytes"]["total"] == plan.totals["bytes"]["total"]
    with pytest.raises(CompressError, match="missing from the plan"):
        run_compress(src, tmp_path / "q2", plan=tmp_path / "plan.json", ignore=[])
