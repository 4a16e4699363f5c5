"""`qpalette compress` → transformers loading: numerics, round trips, resume, bytes, errors."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from helpers import compress_killed_at_second_shard, fake_sensitivity, run_compress
from safetensors import safe_open
from tiny_llama import make_tiny_llama
from typer.testing import CliRunner

import qpalette
from qpalette.cli import app
from qpalette.errors import CheckpointError, CompressError
from qpalette.runtime.checkpoint import simulated_weights

runner = CliRunner()
SCHEMES = ["nuq-4", "vq-2.5", "tcq-2.0", "half-tcq-2.25"]


def load(out, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()


def simulated_model(src, qmodel):
    """Original architecture, weights = unrotated dequantized weights, other tensors as stored
    (16-bit), all in float32."""
    from transformers import AutoModelForCausalLM

    sim = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    layout = qmodel.config.quantization_config.layout()
    with torch.no_grad():
        for v in sim.state_dict().values():
            v.copy_(v.half().float())
        for name, w in simulated_weights(qmodel, layout).items():
            sim.get_submodule(name).weight.copy_(w)
            b = sim.get_submodule(name).bias
            if b is not None:
                b.copy_(b.half().float())
    return sim


def shard_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module")
def one_block_dir(tmp_path_factory):
    """The tiny Llama with one block: trellis quantization on CPU costs ~0.1 s per 16×16 tile."""
    return make_tiny_llama(tmp_path_factory.mktemp("one_block"), num_hidden_layers=1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(  # unfused trellis codes are the same tiles as fused ones (shown with vq)
    "scheme,fuse", [(s, True) for s in SCHEMES] + [("nuq-4", False), ("vq-2.5", False)]
)
def test_loaded_model_equals_simulated(tiny_llama_dir, one_block_dir, tmp_path, ids, scheme, fuse):
    trellis = scheme.startswith(("tcq", "half"))
    src = one_block_dir if trellis else tiny_llama_dir
    rep = run_compress(src, tmp_path / "q", scheme=scheme, fuse=fuse)
    assert rep["avg_bits"] == pytest.approx(float(scheme.split("-")[-1]))
    q = load(tmp_path / "q")
    kinds = {type(m).__name__ for m in q.modules()}
    assert "QuantizedLinear" in kinds and ("FusedSlice" in kinds) == fuse
    assert not any(isinstance(m, torch.nn.Linear) for n, m in q.named_modules() if "layers." in n)
    with torch.no_grad():
        got = q(ids).logits
        want = simulated_model(src, q)(ids).logits
    assert (got - want).norm() / want.norm() < 1e-3


def test_fused_and_unfused_store_the_same_codes(tiny_llama_dir, tmp_path):
    run_compress(tiny_llama_dir, tmp_path / "f", scheme="vq-3.0", fuse=True)
    run_compress(tiny_llama_dir, tmp_path / "u", scheme="vq-3.0", fuse=False)
    f, u = shard_tensors(tmp_path / "f"), shard_tensors(tmp_path / "u")
    p = "model.layers.1.self_attn."
    cat = torch.cat([u[f"{p}{k}_proj.codes"] for k in "qkv"])
    assert torch.equal(f[f"{p}qkv_proj.codes"], cat)
    assert sum(t.nbytes for t in f.values()) == sum(t.nbytes for t in u.values())


def test_generate_and_from_pretrained(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    model = qpalette.from_pretrained(tmp_path / "q", device="cpu")
    assert model.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "q"))
    enc = tok("hello", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == enc["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(out[0]), str)
    card = (tmp_path / "q" / "README.md").read_text()
    assert "import qpalette" in card and "`qpalette_llama.needs-import-qpalette`" in card


def test_plain_transformers_refuses_a_checkpoint(tiny_llama_dir, tmp_path):
    """Without `import qpalette` (a fresh interpreter), from_pretrained fails with a message whose
    model type says what to do, instead of loading random weights; with it, the same call loads,
    save_pretrained keeps the guard, and checkpoints of the earlier type (`qpalette_llama`) load."""
    import subprocess
    import sys

    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    plain = "from transformers import AutoModelForCausalLM as A; A.from_pretrained({!r})"
    res = subprocess.run([sys.executable, "-c", plain.format(str(tmp_path / "q"))], capture_output=True, text=True)
    assert res.returncode != 0 and "does not recognize" in res.stderr
    assert "model type `qpalette_llama.needs-import-qpalette`" in res.stderr
    q = load(tmp_path / "q")
    q.save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["model_type"] == "qpalette_llama.needs-import-qpalette"
    (tmp_path / "again" / "config.json").write_text(json.dumps({**config, "model_type": "qpalette_llama"}))
    old = load(tmp_path / "again")
    assert old.config.model_type == "qpalette_llama" and type(old).__name__ == type(q).__name__


def test_save_pretrained_round_trip_is_bit_exact(one_block_dir, tmp_path, ids):
    run_compress(one_block_dir, tmp_path / "q", scheme="half-tcq-2.25")
    original = shard_tensors(tmp_path / "q")
    for dtype, name in ((None, "auto"), (torch.float32, "fp32")):
        model = load(tmp_path / "q", dtype=dtype or "auto")
        model.save_pretrained(tmp_path / name)
        again = shard_tensors(tmp_path / name)
        quantized = {k: v for k, v in original.items() if not k.endswith((".weight", ".bias"))}
        for k, v in quantized.items():  # codes, scales, signs, codebooks: same dtype and bits
            assert again[k].dtype == v.dtype and torch.equal(again[k], v), k
        assert set(again) == set(original)
        if dtype is None:  # loaded in the stored dtype: every tensor identical
            for k, v in original.items():
                assert again[k].dtype == v.dtype and torch.equal(again[k], v), k
        reloaded = load(tmp_path / name)
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, load(tmp_path / "q")(ids).logits)


def test_dtype_casts_keep_fp16_buffers(tiny_llama_dir, tmp_path):
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-3")
    model = load(tmp_path / "q")
    name = "model.layers.0.self_attn.o_proj.row_scale"
    before = model.state_dict()[name].clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.to(torch.float16), lambda m: m.to(torch.float32)):
        cast(model)
        sd = model.state_dict()
        assert sd[name].dtype == torch.float16 and torch.equal(sd[name], before)
        assert sd["qpalette_codebooks.nuq_3"].dtype == torch.float16



def test_resume_after_kill_gives_identical_shards(one_block_dir, tmp_path, monkeypatch):
    run_compress(one_block_dir, tmp_path / "whole", scheme="tcq-1.5")
    compress_killed_at_second_shard(one_block_dir, tmp_path / "killed", monkeypatch, scheme="tcq-1.5")
    partial = tmp_path / "killed.partial"
    assert partial.is_dir() and not (tmp_path / "killed").exists()
    assert not (partial / "config.json").exists()  # nothing looks complete
    (partial / ".model-00002-of-00002.safetensors.abc.tmp").write_bytes(b"half-written")
    with pytest.raises(CompressError, match="--resume"):
        run_compress(one_block_dir, tmp_path / "killed", scheme="tcq-1.5")
    with pytest.raises(CompressError, match="other settings"):
        run_compress(one_block_dir, tmp_path / "killed", scheme="tcq-2.0", resume=True)
    rep = run_compress(one_block_dir, tmp_path / "killed", scheme="tcq-1.5", resume=True)
    assert rep["resumed"] and not partial.exists()
    shards = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "killed").glob("*.safetensors"))
    assert len(shards) == 2
    for s in shards:
        assert (tmp_path / "whole" / s).read_bytes() == (tmp_path / "killed" / s).read_bytes()
    assert not list((tmp_path / "killed").glob(".*.tmp"))


def test_plan_bytes_equal_written_bytes(tiny_llama_dir, tmp_path, ids):
    sens = fake_sensitivity(tiny_llama_dir, tmp_path / "sens.json")
    res = runner.invoke(app, ["plan", str(tiny_llama_dir), "-b", "3.0bits", "-s", str(sens),
                              "-p", "nuq,vq", "-o", str(tmp_path / "plan.json"), "--no-plot"])
    assert res.exit_code == 0, res.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len({v["quantizer"] for v in plan["layers"].values()}) > 1  # a real mix
    res = runner.invoke(app, ["compress", str(tiny_llama_dir), "--plan", str(tmp_path / "plan.json"),
                              "-o", str(tmp_path / "q"), "-q"])
    assert res.exit_code == 0, res.output
    assert "equal the plan's prediction" in res.output and "import qpalette" in res.output
    written = sum(t.nbytes for t in shard_tensors(tmp_path / "q").values())
    assert written == plan["totals"]["bytes"]["total"]
    report = json.loads((tmp_path / "q" / "qpalette-compress.json").read_text())
    assert report["bytes"] == {**plan["totals"]["bytes"], "total": written} | report["bytes"]
    for k in ("codes_and_row_scales", "sign_vectors", "codebooks", "unquantized_modules"):
        assert report["bytes"][k] == plan["totals"]["bytes"][k], k
    q = load(tmp_path / "q")
    cfg = q.config.quantization_config
    assert cfg.layers == {k: v["quantizer"] for k, v in plan["layers"].items()}
    with torch.no_grad():
        got, want = q(ids).logits, simulated_model(tiny_llama_dir, q)(ids).logits
    assert (got - want).norm() / want.norm() < 1e-3


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_shard_is_named(tiny_llama_dir, tmp_path, damage):
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    shard = tmp_path / "q" / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100] if damage == "truncate" else data[:8] + b"\xff" * 20 + data[28:])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load(tmp_path / "q")


def test_cli_errors_are_messages(tiny_llama_dir, tmp_path):
    cases = [
        (["compress", "/no/such/model", "--scheme", "nuq-4", "-o", str(tmp_path / "a")], "no such"),
        (["compress", str(tiny_llama_dir), "-o", str(tmp_path / "a")], "exactly one"),
        (["compress", str(tiny_llama_dir), "--scheme", "nuq-9", "-o", str(tmp_path / "a")], "unknown quantizer"),
        (["compress", str(tiny_llama_dir), "--plan", str(tmp_path / "nope.json"), "-o", str(tmp_path / "a")],
         "does not exist"),
    ]
    odd = make_tiny_llama(tmp_path / "odd", hidden_size=72, num_attention_heads=4, num_key_value_heads=2)
    cases.append((["compress", str(odd), "--scheme", "nuq-4", "-o", str(tmp_path / "b")], "unsupported layer shapes"))
    cases.append((["compress", str(tiny_llama_dir), "--scheme", "nuq-4", "-o", str(tmp_path / "d"),
                   "--device", "gpu"], "bad --device"))
    other = tmp_path / "gpt2"  # blocks not laid out as model.layers
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 4}))
    cases.append((["compress", str(other), "--scheme", "nuq-4", "-o", str(tmp_path / "c")], "unsupported model"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    cases.append((["compress", str(tiny_llama_dir), "--scheme", "nuq-4", "-o", str(tmp_path / "full")],
                  "--overwrite"))
    for args, msg in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert msg in res.output and "Traceback" not in res.output, (args, res.output)
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_plan_for_another_model_is_refused(tiny_llama_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other", intermediate_size=192)
    sens = fake_sensitivity(other, tmp_path / "sens.json")
    res = runner.invoke(app, ["plan", str(other), "-b", "4bits", "-s", str(sens), "-p", "nuq",
                              "-o", str(tmp_path / "plan.json"), "--no-plot"])
    assert res.exit_code == 0, res.output
    with pytest.raises(CompressError, match="another model"):
        run_compress(tiny_llama_dir, tmp_path / "q", plan=tmp_path / "plan.json")


def test_import_twice_and_register_are_idempotent():
    importlib.reload(qpalette)
    qpalette.register()
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert "qpalette" in AUTO_QUANTIZER_MAPPING


def test_hf_dequantize_gives_the_simulated_model(tiny_llama_dir, tmp_path, ids):
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="vq-2.0")
    q = load(tmp_path / "q")
    with torch.no_grad():
        want = simulated_model(tiny_llama_dir, q)(ids).logits
        q.dequantize()
        assert all(type(m).__module__.startswith("torch") for n, m in q.named_modules() if "proj" in n)
        got = q(ids).logits
    assert (got - want).norm() / want.norm() < 1e-4


def test_torch_compile_runs_the_quantized_model(tiny_llama_dir, tmp_path, ids):
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    q = load(tmp_path / "q")
    compiled = torch.compile(q, backend="eager")
    with torch.no_grad():  # compiled: the ops; eager on CPU: decoded weights (float32 rounding apart)
        torch.testing.assert_close(compiled(ids).logits, q(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_smollm2_compress_load_generate(smollm2_dir, tmp_path):
    """The real model (VQ on CPU: TCQ takes hours here): logits equal the simulated model."""
    from transformers import AutoTokenizer

    rep = run_compress(smollm2_dir, tmp_path / "q", scheme="vq-3.0")
    assert rep["bytes"]["total"] < 0.45 * sum(p.stat().st_size for p in Path(smollm2_dir).glob("*.safetensors"))
    q = load(tmp_path / "q")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "q"))
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        got = q(**enc).logits
        want = simulated_model(smollm2_dir, q)(**enc).logits
    assert (got - want).norm() / want.norm() < 1e-3
    out = q.generate(**enc, max_new_tokens=10, do_sample=False)
    assert len(tok.decode(out[0, enc["input_ids"].shape[1]:]).strip()) > 0


@pytest.mark.gpu
def test_compress_on_cuda_matches_cpu_and_loads_on_cuda(tiny_llama_dir, tmp_path, ids):
    """Quantizing on the GPU writes the same codes (NUQ/VQ exactly); the model runs on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    run_compress(tiny_llama_dir, tmp_path / "cpu", scheme="vq-2.5", device="cpu")
    run_compress(tiny_llama_dir, tmp_path / "gpu", scheme="vq-2.5", device="cuda")
    a, b = shard_tensors(tmp_path / "cpu"), shard_tensors(tmp_path / "gpu")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    cpu = qpalette.from_pretrained(tmp_path / "gpu", device="cpu")
    gpu = qpalette.from_pretrained(tmp_path / "gpu", device="cuda", dtype=torch.float32)
    with torch.no_grad():
        want = cpu(ids).logits
        got = gpu(ids.cuda()).logits.cpu()
    assert (got - want).norm() / want.norm() < 1e-4


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_other_architectures(tmp_path, ids, model_type):
    """Mistral, Qwen2 (q/k/v biases: stored once per fused group) and Qwen3 (q/k norms)."""
    src = make_tiny_llama(tmp_path / model_type, model_type=model_type, head_dim=16)
    rep = run_compress(src, tmp_path / "q", scheme="vq-3.0")
    q = load(tmp_path / "q")
    stored = shard_tensors(tmp_path / "q")
    if model_type == "qwen2":
        assert "model.layers.0.self_attn.qkv_proj.bias" in stored
    if model_type == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in stored
    with torch.no_grad():
        got, want = q(ids).logits, simulated_model(src, q)(ids).logits
    assert (got - want).norm() / want.norm() < 1e-3
    from qpalette.models.topology import load_config, unquantized_params

    assert rep["bytes"]["unquantized_modules"] == 2 * sum(unquantized_params(load_config(src)).values())


def test_random_codes_for_speed_runs(tiny_llama_dir, tmp_path, ids):
    """--random-codes writes the same tensors (names, shapes, bytes) without quantizing."""
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-3")
    rep = run_compress(tiny_llama_dir, tmp_path / "r", scheme="nuq-3", random_codes=True)
    a, b = shard_tensors(tmp_path / "q"), shard_tensors(tmp_path / "r")
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    assert not torch.equal(a["model.layers.0.mlp.down_proj.codes"], b["model.layers.0.mlp.down_proj.codes"])
    assert rep["random_codes"] and "Random code words" in (tmp_path / "r" / "README.md").read_text()
    q = load(tmp_path / "r")
    assert q.config.quantization_config.random_codes is True
    with torch.no_grad():
        assert torch.isfinite(q(ids).logits).all()


@pytest.mark.gpu
def test_greedy_text_same_on_kernels_and_reference_and_compiled(tiny_llama_dir, tmp_path):
    """The CUDA kernels (fp16) generate the CPU reference's greedy tokens, eager and compiled
    with a static cache (torch.compile, CUDA graphs)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="tcq-3.0", device="cuda")
    cpu = qpalette.from_pretrained(tmp_path / "q", device="cpu")
    gpu = qpalette.from_pretrained(tmp_path / "q", device="cuda", dtype=torch.float16)
    ids = torch.tensor([[256, 72, 101, 108, 108, 111]])
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        ref = cpu.generate(ids, **kw)
        eager = gpu.generate(ids.cuda(), **kw, disable_compile=True).cpu()
        compiled = gpu.generate(ids.cuda(), **kw, cache_implementation="static").cpu()
        again = gpu.generate(ids.cuda(), **kw, cache_implementation="static").cpu()
    assert torch.equal(eager, ref) and torch.equal(compiled, ref) and torch.equal(again, ref)


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_lm_head(tmp_path, ids, tied):
    """--lm-head: lm_head stored quantized with its own rotation (no 16-bit copy), the embedding
    kept (a tied one untied), logits equal the simulated model, state_dict round trip bit-exact."""
    src = make_tiny_llama(tmp_path / "src", vocab_size=272, tie_word_embeddings=tied)
    rep = run_compress(src, tmp_path / "q", scheme="nuq-4", lm_head=True)
    stored = shard_tensors(tmp_path / "q")
    assert {"lm_head.codes", "lm_head.row_scale", "rotate_lm_head.signs"} <= set(stored)
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    plain = run_compress(src, tmp_path / "plain", scheme="nuq-4")
    assert rep["bytes"]["codes_and_row_scales"] > plain["bytes"]["codes_and_row_scales"]
    if not tied:  # the head's 16-bit bytes are gone
        assert rep["bytes"]["unquantized_modules"] == plain["bytes"]["unquantized_modules"] - 2 * 272 * 64
    q = load(tmp_path / "q")
    assert q.config.tie_word_embeddings is False
    assert type(q.lm_head).__name__ == "QuantizedLinear"
    sim = simulated_model(src, q)
    with torch.no_grad():
        if tied:  # the simulated head must not overwrite the (16-bit) embedding it was tied to
            sim.lm_head.weight = torch.nn.Parameter(simulated_weights(q, q.config.quantization_config.layout())["lm_head"])
            sim.model.embed_tokens.weight.copy_(stored["model.embed_tokens.weight"].float())
        got, want = q(ids).logits, sim(ids).logits
    assert (got - want).norm() / want.norm() < 1e-3
    q.save_pretrained(tmp_path / "again")
    again = load(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, got)


def test_lm_head_flag_goes_with_a_scheme(tiny_llama_dir, tmp_path):
    sens = fake_sensitivity(tiny_llama_dir, tmp_path / "sens.json")
    res = runner.invoke(app, ["plan", str(tiny_llama_dir), "-b", "3.0bits", "-s", str(sens),
                              "-p", "nuq", "-o", str(tmp_path / "plan.json"), "--no-plot"])
    assert res.exit_code == 0, res.output
    with pytest.raises(CompressError, match="--lm-head goes with --scheme"):
        run_compress(tiny_llama_dir, tmp_path / "q", plan=tmp_path / "plan.json", lm_head=True)
    with pytest.raises(CompressError, match="lm_head"):  # vocab 257: not a multiple of 16 rows
        run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4", lm_head=True)


@pytest.mark.gpu
def test_quantized_lm_head_on_the_kernels(tmp_path, ids):
    """A quantized lm_head runs on the CUDA kernels (its own rotation) like the CPU reference."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    src = make_tiny_llama(tmp_path / "src", vocab_size=272, tie_word_embeddings=True)
    run_compress(src, tmp_path / "q", scheme="tcq-3.0", lm_head=True, device="cuda")
    cpu = qpalette.from_pretrained(tmp_path / "q", device="cpu")
    gpu = qpalette.from_pretrained(tmp_path / "q", device="cuda", dtype=torch.float32)
    with torch.no_grad():
        want = cpu(ids).logits
        got = gpu(ids.cuda()).logits.cpu()
        one = gpu(ids[:, :1].cuda()).logits.cpu()  # batch 2, one token: the GEMV path
    assert (got - want).norm() / want.norm() < 1e-3
    assert (one - want[:, :1]).norm() / want[:, :1].norm() < 1e-3
