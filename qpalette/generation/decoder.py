"""A decoder for any Hugging Face causal LM, original or qpalette-compressed: static KV cache,
one eager prefill, then decode steps replayed as CUDA graphs, the next token chosen on the GPU
inside the graph.

Why our own and not transformers' `generate`: `generate` synchronises with the host after every
token and re-enters a compiled function whose guards and graph-tree bookkeeping cost milliseconds
of host time per token (3.7 ms for a compressed 8B model, measured), which the GPU waits for. Here
a step is one `CUDAGraph.replay()`: every input of the step (token, cache slot, positions, mask,
finished flags) lives in device buffers that the graph itself advances, so the host only enqueues
replays and reads tokens back a few steps behind through pinned memory, without ever stalling
the GPU.

Batches are padded to a bucket (1, 2, 4, 8, …) and prompts of different lengths are left-padded;
each row attends only to its own tokens and counts positions from its first one, so a sequence
gets the tokens it would get alone.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from qpalette.errors import InputError
from qpalette.generation.sampling import SamplingOptions, next_tokens, noise_streams
from qpalette.models.walk import cache_kwarg

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
READ_BEHIND = 8  # steps the host may run ahead of the tokens it has read back
CACHE_ROUND = 16  # cache lengths are rounded up to this, so similar requests share graphs
MAX_EOS = 8  # end-of-sequence ids a run may name


@dataclass
class DecodeResult:
    """New tokens per prompt (the EOS that ended one included) and where the time went."""

    tokens: list[list[int]]
    finished: list[bool]
    prefill_s: float
    decode_s: float
    steps: int
    host_step_s: float
    graphs: bool

    @property
    def decode_tok_per_s(self) -> float:
        """Decode steps per second, per sequence (prefill and its first token excluded)."""
        return self.steps / self.decode_s if self.decode_s > 0 else float("nan")


class SlotKVCache:
    """A static KV cache that writes where `write_at` (a device tensor the decoder owns) says:
    the positions of a prefill, or the one slot of a decode step, which the captured graph
    advances in place. Duck-typed to what transformers' attention layers call (`update`)."""

    def __init__(self, length: int):
        self.length = length
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.write_at: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx not in self.keys:  # first (prefill) call: allocate at this layer's shape
            b, h, _, d = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros(b, h, self.length, d)
            self.values[layer_idx] = value_states.new_zeros(b, h, self.length, d)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        at = self.write_at.to(keys.device)  # a model split over GPUs keeps each layer's cache on its device
        keys.index_copy_(2, at, key_states)
        values.index_copy_(2, at, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


class _Batch:
    """One bucket's state at fixed addresses: what a captured graph reads and advances."""

    def __init__(self, size: int, length: int, device: torch.device):
        self.size, self.length = size, length
        self.cache = SlotKVCache(length)
        zeros = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        self.token, self.slot, self.step, self.seed = zeros(size, 1), zeros(1), zeros(1), zeros(1)
        self.pads, self.done = zeros(size, 1), zeros(size, dtype=torch.bool)
        self.rows = torch.arange(size, device=device)
        self.key_pos = torch.arange(length, device=device)
        self.eos = torch.full((MAX_EOS,), -1, dtype=torch.long, device=device)
        self.pad = zeros(1)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.token, self.slot, self.step, self.done


class Decoder:
    """Generates from token ids with `model`; keeps its caches and graphs between calls.
    `graphs`: replay decode steps as CUDA graphs (default; only on CUDA devices, and not for a model
    split over several devices by a device_map: one graph captures one device's stream). `compile`: the
    step that a graph captures is first compiled by inductor (default with graphs), so that the
    graph replays fused kernels: captured eagerly, a 32-block model's step is ~1000 small kernels,
    and their launch gaps inside the graph cost 1.8 ms a token on an H100 (measured, FP16 8B)."""

    def __init__(self, model, graphs: bool | None = None, compile: bool | None = None):
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self._cache_kw = cache_kwarg(model)  # resolved here, not in the step that dynamo traces
        split = len({p.device for p in model.parameters()}) > 1
        self.graphs = self.device.type == "cuda" and graphs is not False and not split
        self.compile = self.graphs and compile is not False
        self._compiled_step = None
        self._batches: dict[tuple[int, int], _Batch] = {}

    # ---- the public call -------------------------------------------------------------------------
    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingOptions,
                     eos_ids: tuple[int, ...] = (), pad_id: int = 0,
                     on_tokens: Callable[[list[int | None]], None] | None = None,
                     stop_at_eos: bool = True) -> DecodeResult:
        """New tokens for each prompt. `on_tokens` gets, after each step as it is read back, one
        token per prompt (None once that prompt has finished)."""
        # graphs capture and replay on the current device's streams: make it the model's (cuda:1 too)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._generate_ids(prompts, max_new_tokens, sampling, eos_ids, pad_id, on_tokens, stop_at_eos)

    def _generate_ids(self, prompts, max_new_tokens, sampling, eos_ids, pad_id, on_tokens, stop_at_eos):
        state = self._batch_for(prompts, max_new_tokens)
        if len(eos_ids) > MAX_EOS:
            raise InputError(f"{len(eos_ids)} end-of-sequence ids: at most {MAX_EOS}")
        state.eos.fill_(-1)
        state.eos[: len(eos_ids)] = torch.tensor(eos_ids, dtype=torch.long)
        state.pad.fill_(pad_id)
        state.seed.fill_(sampling.seed & 0xFFFFFFFF)
        reader = _Reader(len(prompts), set(eos_ids) if stop_at_eos else set(), on_tokens)
        t0 = time.perf_counter()
        self._prefill(state, prompts, sampling)
        reader.take(state.token.view(-1)[: len(prompts)].tolist())
        prefill_s = time.perf_counter() - t0
        steps, host, decode_s = self._decode(state, sampling, max_new_tokens - 1, reader)
        return DecodeResult(reader.tokens, reader.finished, prefill_s, decode_s, steps,
                            statistics.median(host) if host else 0.0, self._uses_graphs(state, sampling))

    # ---- setup -----------------------------------------------------------------------------------
    def _batch_for(self, prompts: list[list[int]], max_new_tokens: int) -> _Batch:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise InputError(f"max new tokens {max_new_tokens}: must be ≥ 1")
        if len(prompts) > BUCKETS[-1]:
            raise InputError(f"{len(prompts)} prompts: at most {BUCKETS[-1]} at once")
        need = max(map(len, prompts)) + max_new_tokens
        limit = getattr(self.model.config, "max_position_embeddings", None) or need
        if need > limit:
            raise InputError(f"prompt ({max(map(len, prompts))} tokens) + {max_new_tokens} new tokens exceed "
                             f"the model's {limit} positions")
        length = min(-(-need // CACHE_ROUND) * CACHE_ROUND, limit)
        size = next(b for b in BUCKETS if b >= len(prompts))
        key = (size, length)
        if key not in self._batches:
            self._batches[key] = _Batch(size, length, self.device)
        return self._batches[key]

    def _mask(self, state: _Batch, query_pos: torch.Tensor) -> torch.Tensor:
        """(B, 1, Q, L) additive mask: a query at cache slot q sees slots pad..q of its row (and
        itself, so padding rows stay finite)."""
        keys = state.key_pos.view(1, 1, 1, -1)
        q = query_pos.view(1, 1, -1, 1)
        pads = state.pads.view(-1, 1, 1, 1)
        seen = ((keys >= pads) & (keys <= q)) | (keys == q)
        dtype = self.dtype
        return torch.zeros((), dtype=dtype, device=self.device).masked_fill(~seen, torch.finfo(dtype).min)

    def _forward(self, state: _Batch, ids: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """Last-position logits (B, vocab) after writing K/V of `ids` at cache slots `query_pos`."""
        state.cache.write_at = query_pos
        out = self.model(input_ids=ids, position_ids=(query_pos.view(1, -1) - state.pads).clamp_min(0),
                         attention_mask=self._mask(state, query_pos), **{self._cache_kw: state.cache},
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _choose(self, state: _Batch, logits: torch.Tensor, sampling: SamplingOptions) -> None:
        """Pick, mask finished rows to padding, mark rows that just ended, advance the buffers."""
        nxt = next_tokens(logits, sampling, noise_streams(state.seed, state.rows), state.step)
        nxt = torch.where(state.done, state.pad, nxt)
        state.done |= (nxt[:, None] == state.eos[None, :]).any(1)
        state.token.copy_(nxt[:, None])
        state.step += 1

    @torch.no_grad()
    def _prefill(self, state: _Batch, prompts: list[list[int]], sampling: SamplingOptions) -> None:
        width, pad = max(map(len, prompts)), int(state.pad)
        rows = [[pad] * (width - len(p)) + list(p) for p in prompts]
        rows += [[pad] * width] * (state.size - len(prompts))
        pads = [width - len(p) for p in prompts] + [width - 1] * (state.size - len(prompts))
        state.pads.copy_(torch.tensor(pads).view(-1, 1))
        state.done.copy_(torch.arange(state.size) >= len(prompts))
        state.step.zero_()
        ids = torch.tensor(rows, device=self.device)
        logits = self._forward(state, ids, torch.arange(width, device=self.device))
        self._choose(state, logits, sampling)
        state.slot.fill_(width)

    # ---- decode ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _step(self, state: _Batch, sampling: SamplingOptions) -> None:
        """One decode step, entirely on device buffers (what a graph captures)."""
        self._choose(state, self._forward(state, state.token, state.slot), sampling)
        state.slot += 1

    def _uses_graphs(self, state: _Batch, sampling: SamplingOptions) -> bool:
        return self.graphs and _graph_key(sampling) in state.graphs

    def _launcher(self, state: _Batch, sampling: SamplingOptions) -> Callable[[], None]:
        if not self.graphs:
            return lambda: self._step(state, sampling)
        key = _graph_key(sampling)
        while key not in state.graphs and self.graphs:
            try:
                state.graphs[key] = self._capture(state, sampling)
            except RuntimeError as e:  # a model that cannot be compiled or captured still decodes
                what = "compiling the decode step" if self.compile else "CUDA graph capture"
                then = "capturing it uncompiled" if self.compile else "decoding eagerly, with host time on every step"
                warnings.warn(f"qpalette decoder: {what} failed ({str(e).splitlines()[0][:160]}); {then}",
                              stacklevel=3)
                self.compile, self.graphs = False, self.compile
        return state.graphs[key].replay if self.graphs else lambda: self._step(state, sampling)

    def _capture(self, state: _Batch, sampling: SamplingOptions) -> torch.cuda.CUDAGraph:
        """Warm up (compiling, the first time) on a side stream, capture one step, and put the
        buffers back as they were (the warm-up's K/V writes go to a slot the first replay
        overwrites)."""
        if self.compile and self._compiled_step is None:
            self._compiled_step = torch.compile(self._step, dynamic=False)
        step = self._compiled_step if self.compile else self._step
        saved = [b.clone() for b in state.buffers()]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(state, sampling)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(state, sampling)
            return graph
        finally:  # captured or not, the next step starts from the state prefill left
            torch.cuda.synchronize(self.device)
            _restore(state, saved)

    def _decode(self, state: _Batch, sampling: SamplingOptions, steps: int, reader: "_Reader"
                ) -> tuple[int, list[float], float]:
        """Run up to `steps` steps (fewer when every row ended); (steps run, host seconds to
        enqueue each, wall seconds of the whole decode)."""
        if steps <= 0 or reader.all_finished():
            return 0, [], 0.0
        launch = self._launcher(state, sampling)
        back = _ReadBack(state.token.view(-1)[: len(reader.tokens)], self.device)
        host, t0, run = [], time.perf_counter(), 0
        while run < steps and not reader.all_finished():
            a = time.perf_counter()
            launch()
            back.push()
            host.append(time.perf_counter() - a)
            run += 1
            back.pop_ready(reader, wait=back.pending() >= READ_BEHIND)
        back.drain(reader)
        return run, host, time.perf_counter() - t0


def _restore(state: _Batch, saved: list[torch.Tensor]) -> None:
    for b, s in zip(state.buffers(), saved):
        b.copy_(s)


def _graph_key(sampling: SamplingOptions) -> tuple:
    """Captured graphs differ by the sampling code path; the seed lives in a buffer."""
    return (sampling.temperature, sampling.top_k, sampling.top_p)


class _ReadBack:
    """Tokens copied to pinned host memory behind the GPU: the host never waits for a step it
    has just enqueued, only (when READ_BEHIND steps are in flight) for the oldest one."""

    def __init__(self, token: torch.Tensor, device: torch.device):
        self.token, self.cuda = token, device.type == "cuda"
        n = READ_BEHIND + 1
        self.host = [torch.empty(token.shape, dtype=token.dtype, pin_memory=self.cuda) for _ in range(n)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(n)]
        self.queue: deque[int] = deque()
        self.next = 0

    def pending(self) -> int:
        return len(self.queue)

    def push(self) -> None:
        i = self.next
        self.next = (i + 1) % len(self.host)
        self.host[i].copy_(self.token, non_blocking=self.cuda)
        if self.cuda:
            self.events[i].record()
        self.queue.append(i)

    def pop_ready(self, reader: "_Reader", wait: bool) -> None:
        while self.queue:
            i = self.queue[0]
            if self.cuda and not self.events[i].query():
                if not wait:
                    return
                self.events[i].synchronize()
            wait = False
            self.queue.popleft()
            reader.take(self.host[i].tolist())

    def drain(self, reader: "_Reader") -> None:
        while self.queue:
            self.pop_ready(reader, wait=True)


class _Reader:
    """The host's view of the tokens read back: per prompt, tokens up to and including EOS."""

    def __init__(self, n: int, eos: set[int], on_tokens):
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.eos, self.on_tokens = eos, on_tokens

    def all_finished(self) -> bool:
        return all(self.finished)

    def take(self, step_tokens: list[int]) -> None:
        new: list[int | None] = []
        for i, t in enumerate(step_tokens):
            if self.finished[i]:
                new.append(None)
                continue
            self.tokens[i].append(t)
            self.finished[i] = t in self.eos
            new.append(t)
        if self.on_tokens is not None:
            self.on_tokens(new)
