"""Choosing the next token on the device, inside a captured CUDA graph: greedy, or temperature /
top-k / top-p sampling whose randomness is a hash of (seed, sequence, step, token).

Why a hash and not torch's generator: the noise must be the same whether a step runs eagerly,
inside a CUDA graph, on CPU or on CUDA, and whatever ran before it (warm-up, capture, another
batch), so a seed alone reproduces a run. A counter-based hash gives that by construction; a
stateful generator would need its offsets threaded through every graph replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one of them stays below 2**63, so the int64
# arithmetic never overflows on any backend.
_MUL_A, _MUL_B, _GOLDEN = 0x7FEB352D, 0x5BD1E995, 0x1E3779B9


@dataclass(frozen=True)
class SamplingOptions:
    """temperature 0 is greedy (argmax); top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        from qpalette.errors import InputError

        if self.temperature < 0:
            raise InputError(f"--temperature {self.temperature}: must be ≥ 0 (0 is greedy)")
        if self.top_k < 0:
            raise InputError(f"--top-k {self.top_k}: must be ≥ 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p {self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply rounds) on int64 tensors holding 32-bit values."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def noise_streams(seed: torch.Tensor | int, rows: torch.Tensor) -> torch.Tensor:
    """(B,) int64 keys of the noise streams of sequences `rows` under `seed` (a tensor, so that a
    captured graph reads the seed of each run)."""
    return _mix32(_mix32(rows + _GOLDEN) ^ _mix32(torch.as_tensor(seed, device=rows.device) & _MASK32))


def uniform_noise(streams: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) float32 in (0, 1), a pure function of (stream, step, token id).
    `streams`: (B,) from `noise_streams`; `step`: int64 tensor broadcastable to (B,)."""
    row_key = _mix32(streams ^ _mix32(step + _GOLDEN))
    ids = torch.arange(vocab, device=streams.device, dtype=torch.int64)
    h = _mix32(row_key[:, None] ^ _mix32(ids * _GOLDEN))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


# Not compiled: inductor's code generation fails on the cumulative sum over a real vocabulary
# (split scan over 49152 tokens, torch 2.11); run eagerly, its kernels are captured all the same.
@torch.compiler.disable
def filtered_logits(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """logits / temperature with every token outside top-k, and outside the top-p nucleus of the
    tokens top-k kept, at -inf (the most likely token always stays)."""
    scaled = logits.float() / opts.temperature
    if opts.top_k == 0 and opts.top_p >= 1:
        return scaled
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if opts.top_k:
        drop |= rank >= opts.top_k
    if opts.top_p < 1:  # the nucleus of what top-k kept, as transformers' warpers chain them
        probs = ordered.masked_fill(drop, float("-inf")).softmax(-1)
        drop |= (probs.cumsum(-1) - probs) >= opts.top_p  # mass before this token already ≥ p
    drop[..., 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, ordered)


# Vocabulary chunks whose maxima the greedy pick takes first. Compiled, one `argmax` over a 128k
# vocabulary is one program a row: a 20.9 µs kernel a step on an H100, two kernels of 1.7 and 1.6 µs
# this way (results/speed_llama8b_v7/ and _v9/breakdown_2bit.json). 256 divides Llama-3's 128256.
ARGMAX_CHUNK = 256


def argmax_last(scores: torch.Tensor) -> torch.Tensor:
    """scores.argmax(-1) as two reductions (chunk maxima, then the best chunk), with torch's
    answer: the first maximum's index, a NaN counting as the maximum."""
    n = scores.shape[-1]
    if n <= ARGMAX_CHUNK:
        return scores.argmax(-1)
    if n % ARGMAX_CHUNK:
        scores = torch.nn.functional.pad(scores, (0, -n % ARGMAX_CHUNK), value=float("-inf"))
    chunks = scores.unflatten(-1, (-1, ARGMAX_CHUNK))
    best = chunks.amax(-1).argmax(-1, keepdim=True)  # amax keeps a NaN: its chunk wins
    inside = chunks.argmax(-1).gather(-1, best)
    return (best * ARGMAX_CHUNK + inside).squeeze(-1)


def next_tokens(logits: torch.Tensor, opts: SamplingOptions, streams: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) int64 next tokens from (B, vocab) logits. Sampling is the Gumbel-max trick:
    argmax(logits/T + Gumbel noise) draws from softmax(logits/T) over the filtered tokens; the
    noise comes from `streams` (`noise_streams`) at `step` (opts.seed is the caller's to apply)."""
    if opts.greedy:
        return argmax_last(logits)
    noise = uniform_noise(streams, step, logits.shape[-1])
    gumbel = -torch.log(-torch.log(noise))
    return argmax_last(filtered_logits(logits, opts) + gumbel)
