"""Where a decode step's GPU time goes: the kernels of one forward step, by kind.

    python scripts/decode_breakdown.py MODEL_DIR [--batch 1] [--steps 8] [--json out.json]

Loads MODEL_DIR as `qpalette bench` does (FP16 or a qpalette checkpoint), prefills a random
prompt into a static cache, compiles the forward with inductor (the kernels of `qpalette bench`,
launched one by one instead of from a CUDA graph, so the profiler sees each), and records
`--steps` decode steps with torch.profiler. Every kernel's device time is summed into kinds
(qpalette matmul, online Hadamard, cuBLAS GEMM, attention, inductor-fused elementwise/norm,
other) and divided by the steps. Next to it: the step time of the same forward replayed as a CUDA
graph (bench's forward loop); the difference is what launching costs beyond the kernels. Last,
the host time of one CUDA-graph call of the compiled forward (what transformers' `generate`
pays per token before its own bookkeeping, since it synchronises every step).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from qpalette.generation.attention import use_transformers_attention
from qpalette.measure.bench import ATTENTIONS, DecodeLoop, decode_loop_step_time
from qpalette.runtime.loading import load_model

KINDS = (  # first match wins: (kind, substrings of the kernel name, lower case)
    ("qpalette matmul", ("qp::gemv_kernel", "qmm_kernel")),
    ("qpalette dequantize", ("qp::dequant_kernel",)),
    ("online Hadamard", ("hadamard_",)),
    # inductor names a kernel after the ops it fused: those fused with SDPA count here too
    ("attention (cuDNN SDPA + inductor kernels fused with it)", ("flash", "fmha", "attention", "sdpa")),
    ("cuBLAS GEMM/GEMV", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("inductor fused (triton)", ("triton",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def breakdown(model, batch: int, steps: int, prompt_len: int = 64) -> dict:
    from torch.profiler import ProfilerActivity, profile

    loop = DecodeLoop(model, batch, prompt_len, 8 + steps, compile="default")  # kernels launched one by one
    for _ in range(8):
        loop.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.name, e.time_range.elapsed_us()) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    res = aggregate([(name, us) for _, name, us in kernels], steps)
    res["matmul_us_by_position"] = matmul_positions(
        [us for _, name, us in kernels if kind_of(name) == "qpalette matmul"], steps, model.config.num_hidden_layers)
    return res


def aggregate(kernels: list[tuple[str, float]], steps: int) -> dict:
    """Per-step sums of (kernel name, µs) over `steps` steps: by kind, and for the 15 costliest names
    their time and launches (a name launched once a layer is a per-layer kernel)."""
    per_kind, per_kernel, launches, calls = defaultdict(float), defaultdict(float), defaultdict(int), defaultdict(int)
    for name, us in kernels:
        k, t = kind_of(name), us / 1e6 / steps
        per_kind[k] += t
        per_kernel[name[:90]] += t
        launches[k] += 1
        calls[name[:90]] += 1
    top = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15])
    return {
        "kinds_s": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
        "kernels_per_step": {k: v / steps for k, v in launches.items()},
        "kernel_sum_s": sum(per_kind.values()),
        "top_kernels_s": top,
        "top_kernel_launches_per_step": {n: calls[n] / steps for n in top},
    }


def matmul_positions(durations_us: list[float], steps: int, layers: int) -> dict:
    """Mean µs of the qpalette matmuls by their place in the step, from their durations in launch
    order: a step of k matmuls a block over `layers` blocks and t after them (lm_head) gives k
    `per_block` means (e.g. qkv, o, gate/up, down, each over the layers and steps) and the t
    `after_blocks` ones; the isolated kernel benchmark's µs set beside these show what running inside
    the model costs each projection. Empty when the step has fewer matmuls than blocks."""
    n = len(durations_us) // steps if steps else 0
    k = n // layers if layers else 0
    if k == 0:
        return {"per_block": [], "after_blocks": []}
    steps_us = [durations_us[i * n:(i + 1) * n] for i in range(steps)]
    per_block = [sum(s[l * k + j] for s in steps_us for l in range(layers)) / (steps * layers) for j in range(k)]
    after = [sum(s[j] for s in steps_us) / steps for j in range(k * layers, n)]
    return {"per_block": per_block, "after_blocks": after}


def host_call_time(model, batch: int, calls: int = 20, prompt_len: int = 64) -> float:
    """Median host seconds of one step of the CUDA-graph-compiled loop (the GPU idle before each,
    so the call returns once the replay and the argmax are queued): the CPU's share of a step."""
    import statistics
    import time

    loop = DecodeLoop(model, batch, prompt_len, 8 + calls, compile="reduce-overhead")
    times = []
    for _ in range(8 + calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[8:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--attention", choices=ATTENTIONS, default="qpalette",
                    help="qpalette's packed decode attention or transformers' sdpa")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_breakdown needs a CUDA GPU")
    model = load_model(a.model, "cuda", tokenizer=False)[0]
    if a.attention == "sdpa":
        use_transformers_attention(model)
    res = {"model": a.model, "batch": a.batch, "attention": model.config._attn_implementation,
           "device": torch.cuda.get_device_name(), **breakdown(model, a.batch, a.steps)}
    res["graph_step_s"] = decode_loop_step_time(model, a.batch, 64, 32, True, 0)
    res["host_call_s"] = host_call_time(model, a.batch)
    res["tensors"] = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    print(f"{a.model} batch {a.batch}: kernels {res['kernel_sum_s'] * 1e3:.3f} ms a step, "
          f"CUDA-graph step {res['graph_step_s'] * 1e3:.3f} ms, host time of one graph call "
          f"{res['host_call_s'] * 1e3:.3f} ms ({res['tensors']} parameters and buffers)")
    for k, v in res["kinds_s"].items():
        print(f"  {k:56s} {v * 1e3:8.3f} ms  ({res['kernels_per_step'][k]:.0f} kernels)")
    for k, v in res["top_kernels_s"].items():
        print(f"    {v * 1e6:8.1f} us  ({res['top_kernel_launches_per_step'][k]:g} a step)  {k}")
    pos = res["matmul_us_by_position"]
    if pos["per_block"]:
        print("  qpalette matmuls a block, in launch order (us): " + ", ".join(f"{v:.2f}" for v in pos["per_block"])
              + "; after the blocks: " + ", ".join(f"{v:.2f}" for v in pos["after_blocks"]))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
