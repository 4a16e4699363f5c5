"""qpalette::decode_attention: the reference against SDPA on repeated heads; the CUDA kernel (GPU
tests) against the reference on fresh random inputs, every supported group count and head dim."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qpalette.runtime.decode_attention import decode_attention, reference


def _inputs(b, h, kv, length, d, dtype=torch.float32, device="cpu", mask="bool", shared=False, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, d, generator=g, device=device).to(dtype)
    k = torch.randn(b, kv, length, d, generator=g, device=device).to(dtype)
    v = torch.randn(b, kv, length, d, generator=g, device=device).to(dtype)
    rows = 1 if shared else b
    seen = torch.rand(rows, length, generator=g, device=device) < 0.7
    seen[:, -1] = True  # every query sees at least one key
    if mask == "none":
        m = None
    elif mask == "bool":
        m = seen
    else:
        m = torch.zeros(rows, length, device=device).masked_fill(~seen, torch.finfo(dtype).min).to(dtype)
    return q, k, v, m


def _sdpa_repeated(q, k, v, m, scale):
    """What transformers computes: the cache repeated to every query head, SDPA, one query."""
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    attn_mask = None if m is None else m[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kr, vr, attn_mask=attn_mask,
                                                            scale=scale)[:, :, 0]


@pytest.mark.parametrize("mask,shared", [("none", False), ("bool", False), ("bool", True), ("additive", False)])
@pytest.mark.parametrize("h,kv", [(4, 4), (8, 2), (9, 3), (32, 8)])
def test_reference_equals_sdpa_on_repeated_heads(h, kv, mask, shared):
    q, k, v, m = _inputs(3, h, kv, 37, 16, mask=mask, shared=shared)
    torch.testing.assert_close(reference(q, k, v, m, 0.25), _sdpa_repeated(q, k, v, m, 0.25), rtol=1e-5, atol=1e-5)


def test_op_runs_the_reference_on_cpu_and_a_blind_query_gets_zeros():
    q, k, v, m = _inputs(2, 4, 2, 10, 8)
    m[1] = False
    out = decode_attention(q, k, v, m, 0.5)
    assert torch.equal(out, reference(q, k, v, m, 0.5))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


def test_fake_implementation_compiles():
    q, k, v, m = _inputs(1, 4, 2, 12, 8)
    f = torch.compile(lambda *a: decode_attention(*a, 0.3), fullgraph=True)
    torch.testing.assert_close(f(q, k, v, m), reference(q, k, v, m, 0.3))


# ---- the CUDA kernel -----------------------------------------------------------------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from qpalette.runtime import kernel_build

    if not kernel_build.available():
        pytest.skip("kernels off")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_equals_reference(dtype, d):
    """Batch 1–9, every group count 1–8, lengths around the split boundaries (one key, a partial
    warp, one CTA, split in 2…many), each mask kind, shared or per-row masks."""
    _cuda()
    from qpalette.runtime.decode_attention import kernel_applies

    cases = itertools.product([1, 2, 3, 8, 9], range(1, 9), [1, 31, 64, 65, 200, 1000, 4097])
    for i, (b, g, length) in enumerate(cases):
        kv = 2 if g < 5 else 1
        mask = ("none", "bool", "additive")[i % 3]
        q, k, v, m = _inputs(b, g * kv, kv, length, d, dtype, "cuda", mask, shared=i % 2 == 0, seed=i)
        assert kernel_applies(q, k, v, m)
        scale = 1 / math.sqrt(d)
        got, want = decode_attention(q, k, v, m, scale), reference(q, k, v, m, scale)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol,
                                   msg=lambda s: f"b {b} g {g} L {length} mask {mask}: {s}")


@pytest.mark.gpu
def test_kernel_blind_rows_and_splits():
    """A row that sees no key gets zeros; long caches are split over CTAs (and merged right)."""
    _cuda()
    q, k, v, m = _inputs(3, 32, 8, 8192, 128, torch.float16, "cuda", "bool")
    m[1] = False
    m[2, :4000] = False  # whole splits unseen
    out = decode_attention(q, k, v, m, 0.1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out.float(), reference(q, k, v, m, 0.1).float(), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph_and_unsupported_shapes_fall_back():
    """A captured call reads its inputs at replay (new q, cache and mask give new outputs)."""
    _cuda()
    from qpalette.runtime.decode_attention import kernel_applies

    q, k, v, m = _inputs(2, 32, 8, 300, 128, torch.float16, "cuda", "additive")
    decode_attention(q, k, v, m, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, m, 0.1)
    for seed in (1, 2):
        fresh = _inputs(2, 32, 8, 300, 128, torch.float16, "cuda", "additive", seed=seed)
        for mine, new in zip((q, k, v, m), fresh):
            mine.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(*fresh, 0.1).float(), rtol=2e-3, atol=2e-3)
    q, k, v, m = _inputs(2, 8, 2, 50, 96, torch.float16, "cuda", "bool")  # head dim 96: SDPA
    assert not kernel_applies(q, k, v, m)
    torch.testing.assert_close(decode_attention(q, k, v, m, 0.1).float(), reference(q, k, v, m, 0.1).float(),
                               rtol=2e-3, atol=2e-3)


def test_kernel_build_failure_falls_back_to_sdpa(monkeypatch):
    """An FP16 model on a GPU machine without nvcc still decodes: SDPA, one warning, and the failed
    build is not tried again on every call."""
    from qpalette.errors import KernelError
    from qpalette.runtime import decode_attention as mod

    tries = []

    def broken(device=None):
        tries.append(device)
        raise KernelError("building the qpalette CUDA kernels failed (no nvcc)")

    monkeypatch.setattr(mod.kernel_build, "available", broken)
    monkeypatch.setattr(mod, "_build_failed", set())
    mod._warn_once.cache_clear()
    with pytest.warns(UserWarning, match="runs SDPA instead"):
        assert not mod._kernels_built(torch.device("cuda", 0))
    assert not mod._kernels_built(torch.device("cuda", 0)) and len(tries) == 1


def test_mask_rows_keeps_a_batch_stride_and_copies_only_strided_rows():
    """transformers' sdpa mask is one row expanded over the batch: handed to the kernel as it is (no
    copy a layer); only rows whose keys are not adjacent are copied."""
    from qpalette.runtime.decode_attention import _mask_rows

    row = torch.rand(1, 80) < 0.5
    expanded = row.expand(8, 80)
    assert _mask_rows(expanded) is expanded and _mask_rows(None) is None
    strided = (torch.rand(3, 160) < 0.5)[:, ::2]
    rows = _mask_rows(strided)
    assert rows.is_contiguous() and torch.equal(rows, strided)


@pytest.mark.gpu
def test_kernels_read_a_mask_with_its_own_batch_stride():
    """A mask expanded over the batch (stride 0) or cut from a wider buffer (stride > L): both
    kernels give the reference's output, in one kernel launch (no copy of the mask)."""
    _cuda()
    from torch.profiler import ProfilerActivity, profile

    from qpalette.runtime.decode_attention import rope_cache_attention, rope_cache_reference

    b, h, kv, length, d = 8, 32, 8, 80, 128
    q, k, v, _ = _inputs(b, h, kv, length, d, torch.float16, "cuda", "none")
    row = torch.rand(1, length, device="cuda") < 0.7
    row[:, -1] = True
    wide = torch.rand(b, length + 7, device="cuda") < 0.7
    wide[:, length - 1] = True
    for what, m in (("expanded", row.expand(b, length)), ("wider rows", wide[:, :length])):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = decode_attention(q, k, v, m, 0.1)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, f"{what}: {kernels}"
        torch.testing.assert_close(got.float(), reference(q, k, v, m.contiguous(), 0.1).float(), rtol=2e-3,
                                   atol=2e-3, msg=lambda s: f"{what}: {s}")
        args = _rope_inputs(b, h, kv, length, d, torch.float16, "cuda", "none", slot=length - 1)
        mine, theirs = list(args[:8]), [a.clone() for a in args[:8]]
        got = rope_cache_attention(*mine, m, 0.1)
        want = rope_cache_reference(*theirs, m.contiguous(), 0.1)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3, msg=lambda s: f"{what} rope: {s}")


# ---- rope_cache_attention: rope and the cache update in the attention ---------------------------

def _rope_inputs(b, h, kv, length, d, dtype=torch.float32, device="cpu", mask="bool", shared_cos=False, seed=0,
                 slot=None):
    """A q/k/v row (B, (H + 2·KV)·D) sliced as the q/k/v GEMV's output is, cos/sin of random
    positions, caches, the slot (int64) and a mask that sees the slot."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(b, (h + 2 * kv) * d, generator=g, device=device).to(dtype)
    q, k_new, v_new = qkv[:, : h * d], qkv[:, h * d : (h + kv) * d], qkv[:, (h + kv) * d :]
    angle = torch.rand(1 if shared_cos else b, d // 2, generator=g, device=device) * 6.3
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    _, kc, vc, m = _inputs(b, h, kv, length, d, dtype, device, mask, seed=seed + 1)
    at = int(torch.randint(length, (1,), generator=torch.Generator().manual_seed(seed))) if slot is None else slot
    if m is not None:
        m[:, at] = True if m.dtype == torch.bool else 0
    return q, k_new, v_new, cos, sin, kc, vc, torch.tensor(at, device=device), m


def test_rope_reference_is_transformers_rope_cache_update_and_attention():
    """fp32: transformers' apply_rotary_pos_emb, index_copy at the slot, then `reference`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from qpalette.runtime.decode_attention import rope_cache_attention

    q, k_new, v_new, cos, sin, kc, vc, slot, m = _rope_inputs(2, 8, 2, 20, 16)
    qr, kr = apply_rotary_pos_emb(q.reshape(2, 8, 1, 16), k_new.reshape(2, 2, 1, 16), cos[:, None], sin[:, None])
    kc2, vc2 = kc.clone(), vc.clone()
    kc2.index_copy_(2, slot.reshape(1), kr)
    vc2.index_copy_(2, slot.reshape(1), v_new.reshape(2, 2, 1, 16))
    want = reference(qr[:, :, 0], kc2, vc2, m, 0.25)
    torch.testing.assert_close(rope_cache_attention(q, k_new, v_new, cos, sin, kc, vc, slot, m, 0.25), want)
    torch.testing.assert_close(kc, kc2)
    assert torch.equal(vc, vc2)


def test_rope_op_registration():
    """opcheck: schema (the caches mutated), fake implementation, autograd registration."""
    from qpalette.runtime.decode_attention import rope_cache_attention

    torch.library.opcheck(rope_cache_attention, (*_rope_inputs(1, 4, 2, 12, 8), 0.3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_kernel_equals_reference(dtype, d):
    """Batch 1–9, group counts 1–8, lengths from one key to many splits, the slot first, last or
    anywhere (inside a split's keys or on its border), each mask kind, cos per row or one for the
    batch: the output and both caches as the reference's."""
    _cuda()
    from qpalette.runtime.decode_attention import (
        rope_cache_attention,
        rope_cache_reference,
        rope_kernel_applies,
    )

    cases = itertools.product([1, 2, 3, 8, 9], [1, 2, 4, 5, 8], [1, 31, 130, 1000, 4097])
    for i, (b, g, length) in enumerate(cases):
        kv = 2 if g < 5 else 1
        slot = (0, length - 1, None, min(length - 1, 128))[i % 4]
        args = _rope_inputs(b, g * kv, kv, length, d, dtype, "cuda", ("none", "bool", "additive")[i % 3],
                            shared_cos=i % 2 == 0, seed=i, slot=slot)
        assert rope_kernel_applies(*args)
        mine, theirs = list(args), [None if a is None else a.clone() for a in args]
        got = rope_cache_attention(*mine, d ** -0.5)
        want = rope_cache_reference(*theirs, d ** -0.5)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        what = f"b {b} g {g} L {length} slot {int(theirs[7])}"
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda s: f"{what}: {s}")
        torch.testing.assert_close(mine[5], theirs[5], rtol=1e-2, atol=1e-2, msg=lambda s: f"{what} keys: {s}")
        assert torch.equal(mine[6], theirs[6]), what


@pytest.mark.gpu
def test_rope_kernel_in_a_cuda_graph_writes_the_slot_it_reads_at_replay():
    """Captured once, each replay reads the slot anew: three replays at slots 100..102 write the
    value rows there and attend over them."""
    _cuda()
    from qpalette.runtime.decode_attention import rope_cache_attention, rope_cache_reference

    args = _rope_inputs(2, 32, 8, 4096, 128, torch.float16, "cuda", "none", slot=10)
    rope_cache_attention(*args, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_cache_attention(*args, 0.1)
    q, k_new, v_new, cos, sin, kc, vc, slot, _ = args
    for at in (100, 101, 102):
        slot.fill_(at)
        theirs = [a.clone() for a in args[:8]]
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), rope_cache_reference(*theirs, None, 0.1).float(), rtol=2e-3, atol=2e-3)
    assert torch.equal(vc[:, :, 100:103], v_new.reshape(2, 8, 1, 128).expand(2, 8, 3, 128))


@pytest.mark.gpu
def test_rope_kernel_waits_for_the_projection_that_writes_its_input():
    """With programmatic dependent launch the attention may start while the q/k/v GEMV before it
    still runs (here a K = 14336 projection on clusters that leave SMs free). Replayed as one CUDA
    graph (back to back, as in a decode step) with fresh inputs each time, it must read q, k_new and
    v_new only after the GEMV wrote them: a read before sees the previous replay's rows."""
    _cuda()
    from qpalette.quant.palette import get_quantizer
    from qpalette.runtime import lanes, ops
    from qpalette.runtime.decode_attention import rope_cache_attention, rope_cache_reference

    b, h, kv, d, n = 1, 32, 8, 128, 14336
    rows = (h + 2 * kv) * d
    gen = torch.Generator().manual_seed(0)
    stored = {k: v.cuda() for k, v in get_quantizer("tcq-2.0").random_tensors(rows, n, gen).items()}
    tensors = lanes.pack("tcq-2.0", stored)
    _, _, _, cos, sin, kc, vc, slot, m = _rope_inputs(b, h, kv, 300, d, torch.float16, "cuda", "bool", slot=200)
    # x at 0.05: q/k/v rows of about unit size. At x ~ N(0, 1) they are ~20 and the scores ~1e3, a
    # softmax so peaked that two nearly tied keys (fp32 sums in another order) once moved 36 outputs
    # by ~1% (replay 12 of 20); a stale row is off by its whole size either way
    x = 0.05 * torch.randn(1, b, n, device="cuda", dtype=torch.float16)

    def step():
        qkv = ops.quantized_matmul(x, "tcq-2.0", tensors, (rows, n))[0]
        q, k_new, v_new = qkv[:, : h * d], qkv[:, h * d : (h + kv) * d], qkv[:, (h + kv) * d :]
        return q, k_new, v_new, rope_cache_attention(q, k_new, v_new, cos, sin, kc, vc, slot, m, d ** -0.5)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k_new, v_new, out = step()
    for i in range(20):
        x.normal_(0, 0.05)
        before = [kc.clone(), vc.clone()]
        graph.replay()
        torch.cuda.synchronize()
        want = rope_cache_reference(q.clone(), k_new.clone(), v_new.clone(), cos, sin, *before, slot, m, d ** -0.5)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-3, atol=2e-3, msg=lambda s: f"replay {i}: {s}")
        assert torch.equal(vc[:, :, 200], v_new.reshape(b, kv, d)), f"replay {i}: the value row written"


def test_rope_fallback_off_the_kernel_writes_the_caches_and_attends_like_the_reference():
    """Where the rope kernel does not apply (here: CPU tensors) the CUDA implementation ropes and
    writes in torch and hands the attention to decode_attention's own choice (packed SDPA here)."""
    from qpalette.runtime.decode_attention import (
        _rope_cache_attention_cuda,
        rope_cache_reference,
        rope_kernel_applies,
    )

    args = _rope_inputs(2, 8, 2, 20, 16, mask="additive")
    assert not rope_kernel_applies(*args)
    mine, theirs = list(args), [a.clone() for a in args]
    got = _rope_cache_attention_cuda(*mine, 0.25)
    torch.testing.assert_close(got, rope_cache_reference(*theirs, 0.25), rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[5], theirs[5]) and torch.equal(mine[6], theirs[6])
