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
