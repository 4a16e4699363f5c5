"""`qpalette bench`: decode speed, the same harness for FP16 and compressed checkpoints, two ways.

- generate: transformers' `generate` as users run it, with a static KV cache (on CUDA it
  compiles the decode step with torch.compile, mode "reduce-overhead", i.e. CUDA graphs),
  greedy, a random prompt of `prompt_len` tokens per sequence. A stopping criterion records a
  timestamp after every step (after a device synchronise); the step time is the median gap
  between consecutive steps of a second, timed generate call (the first one compiles and warms
  up), so prefill and compilation are excluded. It includes generate's per-token host work
  (logits processors, stopping criteria, bookkeeping), which the GPU waits for.
- loop: the model's forward alone, compiled the same way, one token a step against the same
  static cache, greedy argmax fed back, `gen_len` steps between two CUDA events with no
  synchronise in between: what the GPU needs per token when the host keeps up (as gpt-fast
  style decoders run). The gap between the two is host overhead, not kernels.
tok/s = 1 / step time (per sequence), throughput = batch / step time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from qpalette.devices import resolve_device
from qpalette.errors import InputError
from qpalette.runtime.loading import load_model
from qpalette.runtime.modules import decoded_bytes


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


def random_prompt(model, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    """The (batch, prompt_len) token ids both ways of measuring start from, on the model's device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(model.device)


def decode_step_times(model, batch: int, prompt_len: int, gen_len: int, compile: bool, seed: int) -> list[float]:
    from transformers import StoppingCriteriaList

    device = model.device
    ids = random_prompt(model, batch, prompt_len, seed)
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
              cache_implementation="static", disable_compile=not compile,
              pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    if compile:
        torch._dynamo.reset()
    with torch.no_grad():
        model.generate(ids, **kw)  # compile, capture graphs, warm up
        clock = _StepClock(device)
        model.generate(ids, stopping_criteria=StoppingCriteriaList([clock]), **kw)
    t = clock.times
    return [b - a for a, b in zip(t[1:], t[2:])]  # drop the step that follows prefill


def static_cache(config, batch: int, max_len: int, device, dtype):
    """A transformers StaticCache across versions (5.x sizes it on first use; older ones ask)."""
    import inspect

    from transformers import StaticCache

    if "max_batch_size" in inspect.signature(StaticCache.__init__).parameters:
        return StaticCache(config=config, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype)
    return StaticCache(config=config, max_cache_len=max_len)


class DecodeLoop:
    """Greedy one-token steps of `model.forward` against a static KV cache prefilled with a random
    prompt: the loop that `bench`, `profile` and scripts/decode_breakdown.py time. `compile`: None
    (eager), "reduce-overhead" (inductor + CUDA graphs, as `generate` compiles) or "default"
    (inductor kernels launched one by one)."""

    def __init__(self, model, batch: int, prompt_len: int, steps: int, compile: str | None = None, seed: int = 0):
        device = model.device
        ids = random_prompt(model, batch, prompt_len, seed)
        self.cache = static_cache(model.config, batch, prompt_len + steps, device, model.dtype)
        self.positions = torch.arange(prompt_len + steps, device=device)
        if compile:
            torch._dynamo.reset()  # each loop compiles afresh: no recompile limit hit, no stale graphs
        self.graphs = compile == "reduce-overhead"
        self.forward = torch.compile(model.forward, mode=compile) if compile else model.forward
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=self.cache, use_cache=True, **self._where(0, prompt_len)).logits
        self.tokens = [logits[:, -1:].argmax(-1)]
        self.pos = prompt_len

    def step(self) -> None:
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            logits = self.forward(input_ids=self.tokens[-1], past_key_values=self.cache, use_cache=True,
                                  **self._where(self.pos, self.pos + 1)).logits
        self.tokens.append(logits[:, -1:].argmax(-1))
        self.pos += 1

    def _where(self, a: int, b: int) -> dict:
        """Positions a..b-1 as transformers wants them: cache_position (≤ 5.2x) and position_ids."""
        return {"cache_position": self.positions[a:b], "position_ids": self.positions[a:b].unsqueeze(0)}


def decode_loop_step_time(model, batch: int, prompt_len: int, gen_len: int, compile: bool, seed: int,
                          warmup: int = 4) -> float:
    """Seconds per decode step of the forward alone (see the module docstring), on a fresh cache."""
    loop = DecodeLoop(model, batch, prompt_len, warmup + gen_len, "reduce-overhead" if compile else None, seed)
    for _ in range(warmup):
        loop.step()
    if model.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(gen_len):
            loop.step()
        return (time.perf_counter() - t0) / gen_len
    torch.cuda.synchronize(model.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(gen_len):
        loop.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / gen_len


def bench(opts: BenchOptions, log: Callable[[str], None] = print) -> dict:
    from qpalette.models.sources import ModelError, resolve_model

    device = resolve_device(opts.device)
    if min(opts.batch_sizes) < 1 or opts.prompt_len < 1 or opts.gen_len < 4:
        raise InputError("batch sizes and prompt length must be ≥ 1 and --gen-len ≥ 4")
    try:
        path = resolve_model(opts.model, quiet=True)
    except ModelError as e:
        raise InputError(str(e)) from None
    model, _ = load_model(path, device, tokenizer=False)
    if device.type == "cpu":
        log("note: on CPU there are no CUDA graphs and qpalette layers run on weights decoded once "
            "(QPALETTE_CPU_DECODED_BYTES) or the pure-PyTorch reference: numbers say little about GPU speed")
    rows = []
    for b in opts.batch_sizes:
        steps = decode_step_times(model, b, opts.prompt_len, opts.gen_len, opts.compile and device.type == "cuda",
                                  opts.seed)
        step = statistics.median(steps)
        loop = decode_loop_step_time(model, b, opts.prompt_len, opts.gen_len,
                                     opts.compile and device.type == "cuda", opts.seed)
        rows.append({"batch_size": b, "step_s": step, "tok_per_s": 1 / step, "throughput_tok_per_s": b / step,
                     "steps_timed": len(steps), "step_p10_s": _pct(steps, 10), "step_p90_s": _pct(steps, 90),
                     "loop_step_s": loop, "loop_tok_per_s": 1 / loop, "loop_throughput_tok_per_s": b / loop})
        log(f"batch {b}: generate {1 / step:8.1f} tok/s per sequence, {b / step:8.1f} tok/s total "
            f"(median step {step * 1e3:.3f} ms over {len(steps)} steps); "
            f"forward loop {1 / loop:8.1f} tok/s ({loop * 1e3:.3f} ms a step)")
    return {
        "format": "qpalette.bench/1",
        "model": str(opts.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "compiled": opts.compile and device.type == "cuda",
        "quantized": "quantization_config" in model.config.to_dict(),
        "cpu_decoded_weight_bytes": decoded_bytes() if device.type == "cpu" else None,
        "prompt_len": opts.prompt_len,
        "gen_len": opts.gen_len,
        "torch": torch.__version__,
        "rows": rows,
    }


def _pct(xs: list[float], p: int) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]
