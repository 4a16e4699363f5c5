"""Timing of the quantized matmul kernels on the local GPU (scripts/bench_kernels.py, profile).

Each measurement captures one CUDA graph that calls the op on `copies` different weight copies
(enough bytes to flush the L2 cache between uses of one copy), replays it several times and
reports the median replay time divided by the number of calls: the time of one call as a decode
step would see it, launch gaps removed by the graph, weights streamed from HBM.
"""

from __future__ import annotations

import math
import statistics

import torch

from qpalette.errors import InputError
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes, ops

L2_FLUSH_BYTES = 256 << 20  # bytes of distinct weights a graph cycles through (H100 L2: 50 MB)
MAX_COPIES = 256


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """The kernel scripts' --shapes: '4096x14336, 14336x4096' → [(4096, 14336), (14336, 4096)]
    (rows = out features, cols = in); InputError for anything else."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        rows, sep, cols = item.lower().partition("x")
        if not sep or not rows.isdigit() or not cols.isdigit():
            raise InputError(f"--shapes {item!r}: expected OUTxIN, e.g. 4096x14336")
        shapes.append((int(rows), int(cols)))
    if not shapes:
        raise InputError("--shapes: give at least one OUTxIN")
    return shapes


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def copies_for(nbytes: int) -> int:
    return max(2, min(MAX_COPIES, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1))))


def time_graph(calls, repeats: int = 15) -> float:
    """Median seconds of one call: `calls` is a list of zero-argument callables."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    del g
    return statistics.median(times)


def time_quantized(name: str, rows: int, cols: int, batches, dtype=torch.float16,
                   gen: torch.Generator | None = None) -> tuple[dict[int, float], int]:
    """{batch: seconds} of ops.quantized_matmul on a rows×cols layer, and its stored bytes."""
    def layer():
        return lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, gen, "cuda"))

    first = layer()
    nbytes = stored_bytes(first)
    layers = [first] + [layer() for _ in range(copies_for(nbytes) - 1)]
    out = {}
    for m in batches:
        x = torch.randn(m, cols, device="cuda", dtype=dtype)
        calls = [lambda t=t: ops.quantized_matmul(x, name, t, (rows, cols)) for t in layers]
        out[m] = time_graph(calls)
    del layers
    return out, nbytes


def time_fp16(rows: int, cols: int, batches, dtype=torch.float16) -> dict[int, float]:
    """{batch: seconds} of the dense cuBLAS matmul x · Wᵀ (F.linear) in `dtype`."""
    nbytes = rows * cols * 2
    ws = [torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(copies_for(nbytes))]
    out = {}
    for m in batches:
        x = torch.randn(m, cols, device="cuda", dtype=dtype)
        out[m] = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
    del ws
    return out


def time_rotate(n: int, batches, dtype=torch.float16) -> dict[int, float]:
    from qpalette.quant.incoherence import pack_signs, random_signs

    signs = pack_signs(random_signs(n, seed=0)).cuda()
    out = {}
    for m in batches:
        xs = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(8)]
        out[m] = time_graph([lambda x=x: ops.rotate(x, signs) for x in xs])
    return out


# what a decoder block's fused forward (runtime.modules.install_fused_block) also hands the GEMV that
# rotates its input: "rotate" nothing (o_proj), "norm" the input RMSNorm (q/k/v), "add_norm" the
# residual add and the RMSNorm (gate/up), "gated" silu(gate) ⊙ up in, the residual added to y (down)
BLOCK_FORMS = ("rotate", "norm", "add_norm", "gated")


def fused_layer_calls(name: str, layers: list, shape: tuple[int, int], signs: torch.Tensor, m: int,
                      form: str = "rotate", dtype=torch.float16) -> list:
    """One zero-argument call a weight copy in `layers`: the GEMV with the rotation in its prologue and
    the `form`'s extra work (BLOCK_FORMS), on m activation rows of random values."""
    if form not in BLOCK_FORMS:
        raise InputError(f"unknown block form {form!r}; expected one of {', '.join(BLOCK_FORMS)}")
    rows, cols = shape
    dev = signs.device
    x = torch.randn(m, 2 * cols if form == "gated" else cols, device=dev, dtype=dtype)
    if form == "rotate":
        return [lambda t=t: ops.rotated_matmul(x, signs, name, t, shape) for t in layers]
    if form == "gated":
        res = torch.randn(m, rows, device=dev, dtype=dtype)
        return [lambda t=t: ops.gated_rotated_matmul(x, signs, name, t, shape, res) for t in layers]
    w = torch.rand(cols, device=dev, dtype=dtype) + 0.5
    res = torch.randn(m, cols, device=dev, dtype=dtype) if form == "add_norm" else None
    return [lambda t=t: ops.normed_rotated_matmul(x, w, 1e-5, signs, name, t, shape, res) for t in layers]


def time_rotated_layer(name: str, rows: int, cols: int, batches, fused: bool, dtype=torch.float16,
                       gen: torch.Generator | None = None, form: str = "rotate") -> dict[int, float]:
    """{batch: seconds} of one layer's online rotation and matmul as a decode step runs them: the
    rotation kernel then the GEMV (`fused` False), or the GEMV rotating x in its prologue, with the
    extra work of `form` (fused only: BLOCK_FORMS)."""
    from qpalette.quant.incoherence import pack_signs, random_signs

    signs = pack_signs(random_signs(cols, seed=0)).cuda()
    first = lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, gen, "cuda"))
    layers = [first] + [lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, gen, "cuda"))
                        for _ in range(copies_for(stored_bytes(first)) - 1)]
    out = {}
    for m in batches:
        if fused:
            calls = fused_layer_calls(name, layers, (rows, cols), signs, m, form, dtype)
        else:
            x = torch.randn(m, cols, device="cuda", dtype=dtype)
            calls = [lambda t=t: ops.quantized_matmul(ops.rotate(x, signs), name, t, (rows, cols)) for t in layers]
        out[m] = time_graph(calls)
    del layers
    return out


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)
