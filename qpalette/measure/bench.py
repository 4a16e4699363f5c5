"""`qpalette bench`: decode speed, the same harness for FP16 and compressed checkpoints, two ways.

- generate: transformers' `generate` as users run it, with a static KV cache (on CUDA it
  compiles the decode step with torch.compile, mode "reduce-overhead", i.e. CUDA graphs),
  greedy, a random prompt of `prompt_len` tokens per sequence. A stopping criterion records a
  CUDA event after every step (no synchronise of its own); the step time is the median gap
  between consecutive steps of a second, timed generate call (the first one compiles and warms
  up), so prefill and compilation are excluded. It includes generate's per-token host work
  (logits processors, stopping criteria, bookkeeping) wherever the GPU waits for it.
- loop: the model's forward alone, compiled the same way, one token a step against the same
  static cache, greedy argmax fed back, `gen_len` steps between two CUDA events with no
  synchronise in between: what the GPU needs per token when the host keeps up (as gpt-fast
  style decoders run). The gap between the two is host overhead, not kernels.
- decoder: qpalette's own decoder (qpalette.generation; static cache, decode steps replayed as
  CUDA graphs, tokens read back a few steps behind): what `qpalette generate` gives, timed over
  the whole decode from the first step enqueued to the last token read, with the host's time to
  enqueue each step.
Each compiled way runs with every compile mode asked for (`compile_modes`, qpalette.generation.
hf_compile: "default" is transformers' reduce-overhead; "lean" drops dynamo's module guards;
"deferred" is lean with generate's stop check one step late; "plain" is `model.generate` exactly
as a user calls it: transformers' compile config, and for a qpalette model the stop check it defers
by itself, for an original model none); the loop also records the host's time per compiled call.
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
from qpalette.generation.attention import use_transformers_attention
from qpalette.generation.hf_compile import MODES, compile_config, compile_kwargs, mode_stop_check
from qpalette.generation.sampling import argmax_last
from qpalette.models.walk import cache_kwarg
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
    compile_modes: tuple[str, ...] = ("default",)
    ways: tuple[str, ...] = ("decoder", "generate", "loop")
    attention: str = "qpalette"


WAYS = ("decoder", "generate", "loop")
ATTENTIONS = ("qpalette", "sdpa")  # generation/attention.py's packed decode attention, transformers' own


class _StepClock:
    """A StoppingCriteria that only records when each decode step finished: on CUDA as an event in
    the stream (no wait of its own, so a generate that overlaps host and GPU work stays overlapped),
    elsewhere by the host clock."""

    def __init__(self, device: torch.device):
        self.device, self.marks = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def steps(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.device.type != "cuda":
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]


def random_prompt(model, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    """The (batch, prompt_len) token ids both ways of measuring start from, on the model's device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(model.device)


def decode_step_times(model, batch: int, prompt_len: int, gen_len: int, compile: bool, seed: int,
                      mode: str = "default") -> list[float]:
    from transformers import StoppingCriteriaList

    device = model.device
    ids = random_prompt(model, batch, prompt_len, seed)
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
              cache_implementation="static", disable_compile=not compile,
              pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    if mode != "plain":  # plain: the model's own generation config and generate, as a user calls it
        kw["compile_config"] = compile_config(mode)
    if compile:
        torch._dynamo.reset()
    with torch.no_grad(), mode_stop_check(mode):
        model.generate(ids, **kw)  # compile, capture graphs, warm up
        clock = _StepClock(device)
        model.generate(ids, stopping_criteria=StoppingCriteriaList([clock]), **kw)
    return clock.steps()[1:]  # drop the step that follows prefill


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
    (eager), "reduce-overhead" (inductor + CUDA graphs, as `generate` compiles), "lean" (the same
    without guards on module state, hf_compile) or "default" (inductor kernels launched one by one)."""

    def __init__(self, model, batch: int, prompt_len: int, steps: int, compile: str | None = None, seed: int = 0):
        device = model.device
        ids = random_prompt(model, batch, prompt_len, seed)
        self.cache = static_cache(model.config, batch, prompt_len + steps, device, model.dtype)
        self.positions = torch.arange(prompt_len + steps, device=device)
        if compile:
            torch._dynamo.reset()  # each loop compiles afresh: no recompile limit hit, no stale graphs
        self.graphs = compile in ("reduce-overhead", "lean", "deferred")
        kwargs = compile_kwargs(compile) if compile in ("lean", "deferred") else {"mode": compile}
        self.model = model
        self.cache_kw = cache_kwarg(model)  # resolved here, not in the forward that dynamo traces
        # the greedy pick is compiled with the forward, as the decoder's step is (run eagerly, torch's
        # argmax over a 128k vocabulary showed as a 37 µs kernel in results/speed_llama8b/breakdown_fp16.json)
        self.next_token = torch.compile(self._next_token, **kwargs) if compile else self._next_token
        with torch.no_grad():
            self.tokens = [self._next_token(ids, **self._where(0, prompt_len))]
        self.pos = prompt_len

    def _next_token(self, ids: torch.Tensor, **where) -> torch.Tensor:
        logits = self.model(input_ids=ids, **{self.cache_kw: self.cache}, use_cache=True, logits_to_keep=1,
                            **where).logits
        return argmax_last(logits[:, -1:])

    def step(self) -> None:
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            token = self.next_token(self.tokens[-1], **self._where(self.pos, self.pos + 1))
        # a CUDA graph's output is overwritten by its next replay: keep a copy (8 bytes a row)
        self.tokens.append(token.clone() if self.graphs else token)
        self.pos += 1

    def _where(self, a: int, b: int) -> dict:
        """Positions a..b-1 as transformers wants them: cache_position (≤ 5.2x) and position_ids."""
        return {"cache_position": self.positions[a:b], "position_ids": self.positions[a:b].unsqueeze(0)}


def decode_loop_step_time(model, batch: int, prompt_len: int, gen_len: int, compile: bool, seed: int,
                          warmup: int = 4) -> float:
    """Seconds per decode step of the forward alone (see the module docstring), on a fresh cache."""
    return decode_loop_times(model, batch, prompt_len, gen_len, "reduce-overhead" if compile else None, seed,
                             warmup)[0]


def decode_loop_times(model, batch: int, prompt_len: int, gen_len: int, compile: str | None, seed: int,
                      warmup: int = 4) -> tuple[float, float]:
    """(GPU seconds per decode step, median host seconds per call) of the forward loop."""
    loop = DecodeLoop(model, batch, prompt_len, warmup + gen_len, compile, seed)
    for _ in range(warmup):
        loop.step()
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(model.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    host, t0 = [], time.perf_counter()
    for _ in range(gen_len):
        a = time.perf_counter()
        loop.step()
        host.append(time.perf_counter() - a)
    if not cuda:
        return (time.perf_counter() - t0) / gen_len, statistics.median(host)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / gen_len, statistics.median(host)


def decoder_times(model, batch: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    """qpalette's decoder on the same random prompts, greedy, never stopping early: the second of
    two runs (the first captures the graphs)."""
    from qpalette.generation import Decoder, SamplingOptions

    prompts = random_prompt(model, batch, prompt_len, seed).tolist()
    dec = Decoder(model)
    for _ in range(2):
        r = dec.generate_ids(prompts, gen_len, SamplingOptions(), stop_at_eos=False)
    step = r.decode_s / r.steps
    return {"decoder_step_s": step, "decoder_tok_per_s": 1 / step, "decoder_throughput_tok_per_s": batch / step,
            "decoder_host_step_s": r.host_step_s, "decoder_cuda_graphs": r.graphs}


def _measure_batch(model, opts: BenchOptions, b: int, compiled: bool) -> dict:
    """One row of the report: every way of decoding at batch size b."""
    row: dict = {"batch_size": b}
    for mode in opts.compile_modes if compiled else ("default",):
        key = "" if mode == "default" else f"_{mode}"
        if "generate" in opts.ways:
            steps = decode_step_times(model, b, opts.prompt_len, opts.gen_len, compiled, opts.seed, mode)
            step = statistics.median(steps)
            row.update({f"step{key}_s": step, f"tok_per_s{key}": 1 / step, f"throughput_tok_per_s{key}": b / step,
                        f"steps_timed{key}": len(steps), f"step_p10{key}_s": _pct(steps, 10),
                        f"step_p90{key}_s": _pct(steps, 90)})
        if "loop" in opts.ways:
            loop, loop_host = decode_loop_times(
                model, b, opts.prompt_len, opts.gen_len,
                ("reduce-overhead" if mode in ("default", "plain") else mode) if compiled else None, opts.seed)
            row.update({f"loop{key}_step_s": loop, f"loop{key}_tok_per_s": 1 / loop,
                        f"loop{key}_throughput_tok_per_s": b / loop, f"loop{key}_host_s": loop_host})
    if "decoder" in opts.ways:
        row.update(decoder_times(model, b, opts.prompt_len, opts.gen_len, opts.seed))
    return row


def _describe(row: dict, modes) -> str:
    parts = [f"batch {row['batch_size']}"]
    if "decoder_tok_per_s" in row:
        parts.append(f"decoder {row['decoder_tok_per_s']:8.1f} tok/s per sequence "
                     f"(host {row['decoder_host_step_s'] * 1e3:.3f} ms a step, CUDA graphs "
                     f"{'on' if row['decoder_cuda_graphs'] else 'off'})")
    for mode in modes:
        key = "" if mode == "default" else f"_{mode}"
        if f"tok_per_s{key}" in row:
            parts.append(f"[{mode}] generate {row[f'tok_per_s{key}']:8.1f} tok/s")
        if f"loop{key}_tok_per_s" in row:
            parts.append(f"[{mode}] forward loop {row[f'loop{key}_tok_per_s']:8.1f} tok/s "
                         f"(host {row[f'loop{key}_host_s'] * 1e3:.3f} ms a call)")
    return "; ".join(parts)


def bench(opts: BenchOptions, log: Callable[[str], None] = print) -> dict:
    from qpalette.models.sources import ModelError, resolve_model

    device = resolve_device(opts.device)
    if min(opts.batch_sizes) < 1 or opts.prompt_len < 1 or opts.gen_len < 4:
        raise InputError("batch sizes and prompt length must be ≥ 1 and --gen-len ≥ 4")
    unknown = set(opts.compile_modes) - set(MODES)
    if unknown or not opts.compile_modes:
        raise InputError(f"--compile-modes {','.join(opts.compile_modes)}: choose from {', '.join(MODES)}")
    if not opts.ways or set(opts.ways) - set(WAYS):
        raise InputError(f"--ways {','.join(opts.ways)}: choose from {', '.join(WAYS)}")
    if opts.attention not in ATTENTIONS:
        raise InputError(f"--attention {opts.attention}: choose from {', '.join(ATTENTIONS)}")
    try:
        path = resolve_model(opts.model, quiet=True)
    except ModelError as e:
        raise InputError(str(e)) from None
    model, _ = load_model(path, device, tokenizer=False)
    if opts.attention == "sdpa":
        use_transformers_attention(model)
    if device.type == "cpu":
        log("note: on CPU there are no CUDA graphs and qpalette layers run on weights decoded once "
            "(QPALETTE_CPU_DECODED_BYTES) or the pure-PyTorch reference: numbers say little about GPU speed")
    compiled = opts.compile and device.type == "cuda"
    rows = []
    for b in opts.batch_sizes:
        rows.append(_measure_batch(model, opts, b, compiled))
        log(_describe(rows[-1], opts.compile_modes))
    return {
        "format": "qpalette.bench/2",
        "model": str(opts.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "compiled": compiled,
        "compile_modes": list(opts.compile_modes) if compiled else [],
        "ways": list(opts.ways),
        "attention": model.config._attn_implementation,
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
