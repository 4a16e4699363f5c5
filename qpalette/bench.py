"""`qpalette bench`: decode speed of a model as users run it, the same harness for FP16 and
compressed checkpoints.

transformers' `generate` with a static KV cache (on CUDA it compiles the decode step with
torch.compile, mode "reduce-overhead", i.e. CUDA graphs), greedy, a random prompt of
`prompt_len` tokens per sequence. A stopping criterion records a timestamp after every step
(after a device synchronise); the decode step time is the median gap between consecutive
steps of a second, timed generate call (the first one compiles and warms up), so prefill and
compilation are excluded. tok/s = 1 / step time (per sequence), throughput = batch / step time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .devices import resolve_device


class BenchError(Exception):
    pass


@dataclass
class BenchOptions:
    model: str
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 64
    gen_len: int = 128
    device: str = "auto"
    compile: bool = True
    seed: int = 0


class _StepClock:
    """A StoppingCriteria that only records when each decode step finished."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_for_bench(path: Path, device: torch.device):
    """FP16 on CUDA (float32 on CPU); qpalette checkpoints through qpalette.from_pretrained."""
    from transformers import AutoModelForCausalLM

    from .architecture import load_config
    from .hf_integration import from_pretrained

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if "quantization_config" in load_config(path):
        return from_pretrained(path, device=device, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def decode_step_times(model, batch: int, prompt_len: int, gen_len: int, compile: bool, seed: int) -> list[float]:
    from transformers import StoppingCriteriaList

    device = model.device
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(device)
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
              cache_implementation="static", disable_compile=not compile,
              pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    with torch.no_grad():
        model.generate(ids, **kw)  # compile, capture graphs, warm up
        clock = _StepClock(device)
        model.generate(ids, stopping_criteria=StoppingCriteriaList([clock]), **kw)
    t = clock.times
    return [b - a for a, b in zip(t[1:], t[2:])]  # drop the step that follows prefill


def bench(opts: BenchOptions, log: Callable[[str], None] = print) -> dict:
    from .models import ModelError, resolve_model

    device = resolve_device(opts.device, BenchError)
    if min(opts.batch_sizes) < 1 or opts.prompt_len < 1 or opts.gen_len < 4:
        raise BenchError("batch sizes and prompt length must be ≥ 1 and --gen-len ≥ 4")
    try:
        path = resolve_model(opts.model, quiet=True)
    except ModelError as e:
        raise BenchError(str(e)) from None
    model = load_for_bench(path, device)
    if device.type == "cpu":
        log("note: on CPU there are no CUDA graphs and qpalette layers run the pure-PyTorch "
            "reference (dequantize every step): numbers say little about GPU speed")
    rows = []
    for b in opts.batch_sizes:
        steps = decode_step_times(model, b, opts.prompt_len, opts.gen_len, opts.compile and device.type == "cuda",
                                  opts.seed)
        step = statistics.median(steps)
        rows.append({"batch_size": b, "step_s": step, "tok_per_s": 1 / step, "throughput_tok_per_s": b / step,
                     "steps_timed": len(steps), "step_p10_s": _pct(steps, 10), "step_p90_s": _pct(steps, 90)})
        log(f"batch {b}: {1 / step:8.1f} tok/s per sequence, {b / step:8.1f} tok/s total "
            f"(median step {step * 1e3:.3f} ms over {len(steps)} steps)")
    return {
        "format": "qpalette.bench/1",
        "model": str(opts.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "compiled": opts.compile and device.type == "cuda",
        "quantized": "quantization_config" in model.config.to_dict(),
        "prompt_len": opts.prompt_len,
        "gen_len": opts.gen_len,
        "torch": torch.__version__,
        "rows": rows,
    }


def _pct(xs: list[float], p: int) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]
