"""MoE experts in grouped launches (runtime/experts.py): every (token, choice) slot through its
expert as the launches compute it equals the per-expert path, on fresh random tokens and routes;
on the GPU the kernel does too, without a host readback, so a decode step captures in a CUDA graph."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_compress
from tiny_llama import make_tiny_llama

import qpalette
from qpalette.models.experts import PerExpertMLP
from qpalette.models.topology import linear_layers, load_config
from qpalette.runtime import experts as grouped_experts
from qpalette.runtime.experts import QuantizedExperts

EXPERTS, TOP_K = 4, 2
#: a tiny Qwen3-MoE the expert GEMV takes: inputs of 256, whole groups of 128 columns in each of
#: half-TCQ's two code segments
MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 64, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
       "moe_intermediate_size": 256}


def mixed_plan(src, tmp_path):
    """A 4-bit NUQ plan where expert 0 (the sensitive one) gets more bits than experts 1..3."""
    layers = linear_layers(load_config(src))
    sens = tmp_path / "sens.json"
    sens.write_text(json.dumps({"format": "qpalette.sensitivity/1", "model": str(src), "protocol": "test",
                                "tokens": None, "layers": {
                                    l.name: {"a": 100.0 if ".experts.0." in l.name else 0.01 if ".experts." in l.name
                                             else 1.0, "r2": None, "shape": [l.out_features, l.in_features]}
                                    for l in layers}}))
    qpalette.plan(str(src), "4bits", sensitivity=sens, output=tmp_path / "plan.json", palette=["nuq"])
    return tmp_path / "plan.json"


@pytest.fixture(scope="module", params=["uniform", "mixed"])
def compressed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_llama(root / "src", **MOE)
    # uniform: half-TCQ's two code segments, random code words (the CPU's trellis search is slow)
    kw = {"plan": mixed_plan(src, root)} if request.param == "mixed" else {"scheme": "half-tcq-3.25",
                                                                           "random_codes": True}
    run_compress(src, root / "q", **kw)
    return request.param, root / "q"


def routes(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k choices (one of them outside the experts: a masked choice adds nothing) and weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    idx[0, -1] = -1
    return idx, torch.rand(tokens, TOP_K, generator=g)


def experts_of(model) -> list[QuantizedExperts]:
    found = [m for m in model.modules() if isinstance(m, PerExpertMLP)]
    assert found and all(type(m) is QuantizedExperts for m in found)
    return found


def test_grouped_slots_equal_the_per_expert_path(compressed):
    kind, q = compressed
    model, _ = qpalette.load_model(q)
    for b, moe in enumerate(experts_of(model)):
        plan = moe.plan()
        assert plan is not None
        assert (max(len(plan[0]), len(plan[1])) > 1) == (kind == "mixed")  # a launch per entry
        for tokens in (1, 3, 8):
            idx, w = routes(tokens, seed=10 * b + tokens)
            h = torch.randn(tokens, MOE["hidden_size"], generator=torch.Generator().manual_seed(tokens))
            with torch.no_grad():
                got = moe.grouped(h, idx, w, plan)
                want = PerExpertMLP.forward(moe, h, idx, w)
            assert (got - want).norm() / want.norm() < 1e-5, (kind, b, tokens)


def test_a_replaced_expert_layer_is_seen(compressed):
    """A layer swapped after the plan was made (peft wrapping it in a LoRA layer, say): the plan is
    checked again and the experts fall back to the per-expert path."""
    _, q = compressed
    model, _ = qpalette.load_model(q)
    moe = experts_of(model)[0]
    plan = moe.plan()
    assert plan is not None
    torch.nn.Sequential(torch.nn.Linear(2, 2))  # modules registered elsewhere (a compiler's graphs)
    assert moe.plan() is plan
    moe[1].up_proj = torch.nn.Linear(MOE["hidden_size"], MOE["moe_intermediate_size"], bias=False)
    assert moe.plan() is None


def test_experts_whose_input_the_gemv_cannot_rotate_stay_per_expert(compressed, monkeypatch):
    """The expert GEMV has no separate rotation to fall back on: an entry and width it cannot rotate
    (half-TCQ over 128 columns: two segments of 64) leave the experts on the per-expert path."""
    from qpalette.runtime import ops

    assert ops.gemv_rotates_entry("tcq-2.0", 128) and not ops.gemv_rotates_entry("half-tcq-3.25", 128)
    assert ops.gemv_rotates_entry("half-tcq-3.25", 256) and not ops.gemv_rotates_entry("tcq-2.0", 96)
    _, q = compressed
    model, _ = qpalette.load_model(q)
    moe = experts_of(model)[0]
    monkeypatch.setattr(ops, "gemv_rotates_entry", lambda entry, n: n != MOE["moe_intermediate_size"])
    assert moe.plan() is None


def test_dequantized_experts_go_back_to_the_per_expert_module(compressed):
    from qpalette.runtime.checkpoint import Layout, dequantize_model

    _, q = compressed
    model, _ = qpalette.load_model(q)
    dequantize_model(model, Layout.from_config(model.config.quantization_config.to_dict()), torch.float32)
    assert not any(isinstance(m, QuantizedExperts) for m in model.modules())
    assert any(type(m) is PerExpertMLP for m in model.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_expert_kernel_equals_the_per_expert_kernels(compressed, dtype):
    """The grouped launches on the GPU against the per-expert path on the same kernels and against
    the reference launches, 1..8 tokens, fresh routes."""
    kind, q = compressed
    model, _ = qpalette.load_model(q, device="cuda", dtype=dtype)
    for b, moe in enumerate(experts_of(model)):
        assert moe.plan() is not None
        for tokens in (1, 2, 5, 8):
            idx, w = routes(tokens, seed=100 + 10 * b + tokens)
            idx, w = idx.cuda(), w.cuda().to(dtype)
            h = torch.randn(tokens, MOE["hidden_size"], device="cuda", dtype=dtype)
            with torch.no_grad():
                got = moe(h, idx, w)
                per_expert = PerExpertMLP.forward(moe, h, idx, w)
                ref = moe.grouped(h.cpu().float(), idx.cpu(), w.cpu().float(), _on_cpu(moe))
            assert (got.float() - per_expert.float()).norm() / per_expert.float().norm() < 2e-2, (kind, tokens)
            assert (got.float().cpu() - ref).norm() / ref.norm() < 2e-2, (kind, tokens)


def _on_cpu(moe: QuantizedExperts):
    """The same launches with every tensor on the CPU (the reference path)."""
    ins, outs = moe.plan()

    def moved(launch):
        members = [tuple(t.cpu() if t is not None else None for t in m) for m in launch.members]
        return grouped_experts.Launch(launch.quantizer, launch.rows, launch.member_of.cpu(), members,
                                      launch.table.cpu())

    return [moved(l) for l in ins], [moved(l) for l in outs]


@pytest.mark.gpu
def test_a_decode_step_of_experts_captures_in_a_cuda_graph(compressed):
    """No host readback: the experts' call captures, and replays with new routes read on the GPU."""
    _, q = compressed
    model, _ = qpalette.load_model(q, device="cuda", dtype=torch.float16)
    moe = experts_of(model)[0]
    idx, w = routes(4, seed=1)
    idx, w = idx.cuda(), w.cuda().half()
    h = torch.randn(4, MOE["hidden_size"], device="cuda", dtype=torch.float16)
    with torch.no_grad():
        moe(h, idx, w)  # eager first: the plan and tables
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(h, idx, w)
        new_idx, new_w = routes(4, seed=2)
        idx.copy_(new_idx)
        w.copy_(new_w)
        graph.replay()
        want = moe(h, idx, w)
    torch.testing.assert_close(out, want)


@pytest.mark.gpu
def test_compiled_experts_do_not_recompile_per_step(compressed):
    """Under torch.compile (transformers' generate, the bench loop) the grouped experts trace once:
    new routes, same shapes, no recompile, same result as eager."""
    _, q = compressed
    model, _ = qpalette.load_model(q, device="cuda", dtype=torch.float16)
    moe = experts_of(model)[0]
    compiled = torch.compile(moe)
    h = torch.randn(2, MOE["hidden_size"], device="cuda", dtype=torch.float16)
    with torch.no_grad():
        for seed in range(2):
            idx, w = routes(2, seed=seed)
            compiled(h, idx.cuda(), w.cuda().half())
        with torch.compiler.set_stance("fail_on_recompile"):
            for seed in range(2, 5):
                idx, w = routes(2, seed=seed)
                idx, w = idx.cuda(), w.cuda().half()
                got, want = compiled(h, idx, w).float(), moe(h, idx, w).float()
                assert (got - want).norm() / want.norm() < 1e-2  # inductor fuses the fp16 roundings


@pytest.mark.gpu
def test_the_decoder_replays_graphs_on_an_moe_model(compressed):
    from qpalette.generation import Decoder, SamplingOptions

    _, q = compressed
    model, _ = qpalette.load_model(q, device="cuda", dtype=torch.float16)
    r = Decoder(model).generate_ids([[1, 2, 3], [4, 5]], 6, SamplingOptions(), stop_at_eos=False)
    assert r.graphs and all(len(t) == 6 for t in r.tokens)
