"""The bitshift trellis of TCQ (docs/method.md §2): hybrid-code state values, tail-biting Viterbi, streams.

A tile is 128 steps of V = 2 weights. The state is a 16-bit window; each step shifts in KV bits,
so the predecessors of s are the 2^KV states whose low 16−KV bits equal s >> KV. Viewing the
cost vector as (2^KV, 2^(16−KV)) makes "best predecessor" a min over the first axis and the next
cost a broadcast add over (2^(16−KV), 2^KV): O(2^16) work per step, not O(2^16 · 2^KV).
That batched torch code is the reference and runs on CPU (tiles in chunks sized to a memory
budget, so any matrix size works); on a GPU with the kernels on, `quantize_tiles` runs the CUDA
Viterbi instead (runtime/cuda/viterbi.cu: the per-step minima in shared memory; 12× faster on an
H100, results/pipeline_8b), and `QPALETTE_KERNELS=0` selects the reference there too.
"""

from __future__ import annotations

import functools

import torch

from qpalette.quant.bitpack import from_bits, read_fields, to_bits

STATE_BITS = 16
NUM_STATES = 1 << STATE_BITS
STEPS = 128  # per 16×16 tile, two weights a step


def lut_bits(kv: int) -> int:
    """Q, the index width of the hybrid table, for KV bits per step."""
    return 9 if kv <= 8 else kv + 1


@functools.lru_cache(maxsize=None)
def _hash_parts(q: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.arange(NUM_STATES, dtype=torch.int64)
    h = (s * (s + 1)) & 0xFFFF
    idx = (h >> (15 - q)) & ((1 << q) - 1)
    sign = 1.0 - 2.0 * ((h >> 15) & 1).double()
    return idx, sign


def state_values(table: torch.Tensor) -> torch.Tensor:
    """(65536, 2) reconstruction of every state from the hybrid table T (2^Q, 2)."""
    q = table.shape[0].bit_length() - 1
    idx, sign = (p.to(table.device) for p in _hash_parts(q))
    t = table.double()[idx]
    return torch.stack((sign * t[:, 0], t[:, 1]), dim=-1).to(table.dtype)


def _viterbi(
    x: torch.Tensor, values: torch.Tensor, kv: int, tie: torch.Tensor | None
) -> torch.Tensor:
    """Best state path (B, 128) for x (B, 128, 2); `tie` (B,) forces the tail-biting ends.

    With `tie`, s_0 >> kv == tie and s_127 mod 2^(16−kv) == tie.
    """
    b = x.shape[0]
    hi, lo = 1 << kv, 1 << (STATE_BITS - kv)
    dev = x.device
    # distance up to a per-step constant: |v|² − 2 v·x, as one (B,3)@(3,S) product per step
    v3 = torch.cat([values, (values * values).sum(-1, keepdim=True)], dim=-1).T.contiguous()
    x3 = torch.cat([-2 * x, torch.ones_like(x[..., :1])], dim=-1)
    back = torch.empty(b, STEPS, lo, dtype=torch.int16, device=dev)
    cost = x3[:, 0] @ v3
    states = torch.arange(NUM_STATES, device=dev)
    if tie is not None:
        cost.masked_fill_((states >> kv)[None, :] != tie[:, None], float("inf"))
    spare = torch.empty_like(cost)
    for t in range(1, STEPS):
        best, arg = cost.view(b, hi, lo).min(dim=1)
        back[:, t] = arg
        torch.mm(x3[:, t], v3, out=spare)
        spare.view(b, lo, hi).add_(best.unsqueeze(-1))
        cost, spare = spare, cost
    if tie is not None:
        cost.masked_fill_((states & (lo - 1))[None, :] != tie[:, None], float("inf"))
    path = torch.empty(b, STEPS, dtype=torch.int64, device=dev)
    s = cost.argmin(dim=-1)
    path[:, -1] = s
    rows = torch.arange(b, device=dev)
    for t in range(STEPS - 1, 0, -1):
        top = s >> kv
        s = (back[rows, t, top].to(torch.int64) << (STATE_BITS - kv)) | top
        path[:, t - 1] = s
    return path


def _tail_biting_paths(x: torch.Tensor, values: torch.Tensor, kv: int) -> torch.Tensor:
    """docs/method.md §2: Viterbi on the tile rolled by 64 steps fixes the wrap, then a tied re-run."""
    rolled = _viterbi(torch.roll(x, -STEPS // 2, dims=1), values, kv, None)
    tie = rolled[:, STEPS // 2] >> kv  # state aligned with step 0, its top 16−kv bits
    return _viterbi(x, values, kv, tie)


def chunk_tiles(kv: int, device: torch.device, budget_bytes: int | None = None) -> int:
    """How many tiles one Viterbi batch may hold within a memory budget."""
    if budget_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int(free * 0.5)
        else:
            budget_bytes = 1 << 30
    per_tile = 4 * 4 * NUM_STATES + 2 * STEPS * (NUM_STATES >> kv) + 64 * STEPS
    return max(1, budget_bytes // per_tile)


def kernel_paths(x: torch.Tensor, table: torch.Tensor, kv: int) -> torch.Tensor | None:
    """Tail-biting paths of tiles x (N, 128, 2) by the CUDA kernel, or None where it does not run
    (CPU tensors, QPALETTE_KERNELS=0, a GPU whose shared memory per block cannot hold the
    trellis's minima, e.g. KV = 2 on a 99 KB card; a failed build raises KernelError rather than
    silently falling back)."""
    from qpalette.runtime import kernel_build

    if not x.is_cuda or not kernel_build.available(x.device):
        return None
    dev = x.device
    with torch.cuda.device(dev):
        return kernel_build.extension(dev).viterbi(
            x.contiguous(), table.to(dev, torch.float32).contiguous(), kv, table.shape[0].bit_length() - 1,
            torch.cuda.current_stream(dev).cuda_stream, torch.cuda.get_device_properties(dev).multi_processor_count,
        )


def quantize_tiles(
    tiles: torch.Tensor, table: torch.Tensor, kv: int, budget_bytes: int | None = None
) -> torch.Tensor:
    """Tail-biting TCQ of tiles (N, 256) (fragment order) → state paths (N, 128) int64."""
    n = tiles.shape[0]
    x = tiles.reshape(n, STEPS, 2).float()
    fast = kernel_paths(x, table, kv) if n else None
    if fast is not None:
        return fast
    values = state_values(table.to(tiles.device, torch.float32))
    chunk = chunk_tiles(kv, tiles.device, budget_bytes)
    return torch.cat(
        [_tail_biting_paths(x[i : i + chunk], values, kv) for i in range(0, n, chunk)]
    ) if n else torch.empty(0, STEPS, dtype=torch.int64, device=tiles.device)


def paths_to_stream(paths: torch.Tensor, kv: int) -> torch.Tensor:
    """(N, 128) tail-biting state paths → (N, 128·kv) bits: s_0 in full, then kv new bits a step."""
    first = to_bits(paths[:, :1], STATE_BITS)
    rest = to_bits(paths[:, 1:] & ((1 << kv) - 1), kv)
    return torch.cat([first, rest], dim=-1)[:, : STEPS * kv]


def stream_to_states(bits: torch.Tensor, kv: int) -> torch.Tensor:
    """(N, 128·kv) bits → (N, 128) states: step t reads the 16-bit window at t·kv, circularly."""
    length = STEPS * kv
    offsets = torch.arange(STEPS, device=bits.device)[:, None] * kv + torch.arange(
        STATE_BITS, device=bits.device
    )
    window = bits[:, offsets % length]  # (N, 128, 16)
    return from_bits(window.reshape(bits.shape[0], STEPS * STATE_BITS), STATE_BITS)


def words_to_states(words: torch.Tensor, kv: int) -> torch.Tensor:
    """(N, 4·kv) int32 code words → (N, 128) states; equals stream_to_states(unpack_bits(words))
    without expanding every bit."""
    offsets = torch.arange(STEPS, device=words.device) * kv
    return read_fields(words, offsets, STATE_BITS)
