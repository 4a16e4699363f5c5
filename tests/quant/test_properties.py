"""Property-based (hypothesis) tests of the package's invertible pieces.

- bit packing (`quant/bitpack.py`): codes → words → codes for every width 1..32 and any
  positive shape, words ↔ bits both ways, the documented MSB-first stream order, circular
  field reads;
- trellis code streams (`quant/trellis.py`, the palette's TCQ / half-TCQ): a tail-biting code
  stream ↔ its state path both ways, the encoder's words decode to the encoder's paths, random
  stored code words survive unpack → repack; NUQ/VQ codes survive decode → encode;
- the runtime lane-major layout (`runtime/lanes.py`): unpack(pack(t)) == t for every palette entry;
- plan documents (`planning/document.py`): dict and file round trips, synthetic and real plans;
- the Hadamard transform (`quant/hadamard.py`) at every supported size up to 2^15 (non-powers
  of two included): orthogonal (norm kept) and inverted by its transpose; tiles and sign packing.
"""

from __future__ import annotations

import json
import math
import tempfile
from functools import reduce
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qpalette.errors import UnsupportedShape
from qpalette.planning.budget import Budget
from qpalette.planning.document import PLAN_FORMAT, Plan, PlanBlock, PlanGroup, PlanLayer
from qpalette.quant.bitpack import pack_bits, pack_codes, read_fields, unpack_bits, unpack_codes
from qpalette.quant.hadamard import decompose, hadamard_matrix, hadamard_transform
from qpalette.quant.incoherence import pack_signs, rotate_weight, unpack_signs, unrotate_weight
from qpalette.quant.palette import PALETTE, get_quantizer
from qpalette.quant.tiles import TILE, from_tiles, to_tiles
from qpalette.quant.trellis import (
    STATE_BITS,
    STEPS,
    paths_to_stream,
    quantize_tiles,
    stream_to_states,
    words_to_states,
)
from qpalette.runtime import lanes

REF = Path(__file__).resolve().parents[2] / "profiles" / "reference"

ENTRIES = sorted(PALETTE)
TRELLIS = [n for n in ENTRIES if PALETTE[n].family in ("tcq", "half-tcq")]
SCALAR_VECTOR = [n for n in ENTRIES if PALETTE[n].family in ("nuq", "vq")]


def _tcq_parts(name: str):
    """(stored code tensor, the TCQ that wrote it) pairs of a trellis entry."""
    q = PALETTE[name]
    return list(zip(("codes_a", "codes_b"), q.halves)) if q.family == "half-tcq" else [("codes", q)]


KVS = sorted({t.kv for n in TRELLIS for _, t in _tcq_parts(n)})  # 2..10 today


def _int32_words(shape) -> st.SearchStrategy:
    return hnp.arrays(np.int32, shape, elements=st.integers(-(2**31), 2**31 - 1))


def _popcount(words: torch.Tensor) -> int:
    return int(unpack_bits(words).sum())


# -- 1. bit packing ---------------------------------------------------------------------------
@st.composite
def codes_and_width(draw):
    width = draw(st.integers(1, 32))
    unit = 32 // math.gcd(width, 32)  # fewest codes filling whole words
    lead = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    shape = (*lead, unit * draw(st.integers(1, 4)))
    codes = draw(hnp.arrays(np.int64, shape, elements=st.integers(0, 2**width - 1)))
    return torch.from_numpy(codes), width


@settings(max_examples=200, deadline=None)
@given(codes_and_width())
def test_pack_codes_then_unpack_codes_is_the_identity(cw):
    codes, width = cw
    words = pack_codes(codes, width)
    assert words.dtype == torch.int32
    assert words.shape == (*codes.shape[:-1], codes.shape[-1] * width // 32)
    assert torch.equal(unpack_codes(words, width), codes)


@settings(max_examples=100, deadline=None)
@given(codes_and_width())
def test_pack_codes_follows_the_documented_msb_first_stream(cw):
    """Stream bit i = bit (width−1−i mod width) of code i // width; word j holds stream bits
    32j..32j+31 with bit 31 first (a pure-Python reading, independent of the torch code)."""
    codes, width = cw
    words = pack_codes(codes, width).reshape(-1, codes.shape[-1] * width // 32)
    for row_codes, row_words in zip(codes.reshape(-1, codes.shape[-1]).tolist(), words.tolist()):
        stream = "".join(format(c, f"0{width}b") for c in row_codes)
        want = [int(stream[32 * j : 32 * j + 32], 2) for j in range(len(stream) // 32)]
        assert [w & 0xFFFFFFFF for w in row_words] == want


@settings(max_examples=100, deadline=None)
@given(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4).flatmap(_int32_words))
def test_words_to_bits_to_words_is_the_identity(words):
    w = torch.from_numpy(words)
    bits = unpack_bits(w)
    assert bits.shape == (*w.shape[:-1], 32 * w.shape[-1])
    assert bits.max() <= 1
    assert torch.equal(pack_bits(bits), w)


@settings(max_examples=100, deadline=None)
@given(
    hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=3).flatmap(
        lambda lead: st.integers(1, 4).flatmap(
            lambda w: hnp.arrays(np.uint8, (*lead[:-1], 32 * w), elements=st.integers(0, 1))
        )
    )
)
def test_bits_to_words_to_bits_is_the_identity(bits):
    b = torch.from_numpy(bits)
    assert torch.equal(unpack_bits(pack_bits(b)), b)


@st.composite
def words_offsets_width(draw):
    n_words = draw(st.integers(1, 6))
    words = draw(_int32_words((n_words,)))
    width = draw(st.integers(1, 32))
    offsets = draw(st.lists(st.integers(0, 32 * n_words - 1), min_size=1, max_size=16))
    return torch.from_numpy(words), torch.tensor(offsets), width


@settings(max_examples=200, deadline=None)
@given(words_offsets_width())
def test_read_fields_reads_the_stream_circularly(wow):
    words, offsets, width = wow
    stream = "".join(format(w & 0xFFFFFFFF, "032b") for w in words.tolist())
    want = [int("".join(stream[(o + i) % len(stream)] for i in range(width)), 2) for o in offsets.tolist()]
    assert read_fields(words, offsets, width).tolist() == want


# -- 2. trellis code streams ------------------------------------------------------------------
@st.composite
def kv_and_streams(draw):
    kv = draw(st.sampled_from(KVS))
    n = draw(st.integers(1, 3))
    bits = draw(hnp.arrays(np.uint8, (n, STEPS * kv), elements=st.integers(0, 1)))
    return kv, torch.from_numpy(bits)


@settings(max_examples=60, deadline=None)
@given(kv_and_streams())
def test_tail_biting_stream_and_state_path_are_inverse(ks):
    """Every 128·kv-bit stream is a valid tail-biting code: its states are the circular 16-bit
    windows at t·kv, they obey the shift rule and wrap, and packing the path gives the stream back
    (bit-level and word-level readers agree)."""
    kv, bits = ks
    states = stream_to_states(bits, kv)
    length = STEPS * kv
    for row, row_states in zip(bits.tolist(), states.tolist()):
        want = [int("".join(str(row[(t * kv + i) % length]) for i in range(STATE_BITS)), 2) for t in range(STEPS)]
        assert row_states == want
    lo_mask = (1 << (STATE_BITS - kv)) - 1
    assert torch.equal(states[:, 1:] >> kv, states[:, :-1] & lo_mask)  # shift rule
    assert torch.equal(states[:, 0] >> kv, states[:, -1] & lo_mask)  # tail-biting wrap
    assert torch.equal(paths_to_stream(states, kv), bits)
    words = pack_bits(bits)
    assert words.shape == (bits.shape[0], 4 * kv)
    assert torch.equal(words_to_states(words, kv), states)
    assert torch.equal(unpack_bits(words), bits)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(TRELLIS),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
)
def test_stored_trellis_codes_survive_unpack_and_repack(name, row_tiles, col_pairs, seed):
    """Random stored code words (every word sequence is a valid stream) → states → words."""
    q = get_quantizer(name)
    rows, cols = TILE * row_tiles, 2 * TILE * col_pairs
    tensors = q.random_tensors(rows, cols, torch.Generator().manual_seed(seed))
    for key, tcq in _tcq_parts(name):
        codes = tensors[key]
        flat = codes.reshape(-1, codes.shape[-1])
        assert flat.shape[-1] == 4 * tcq.kv
        states = words_to_states(flat, tcq.kv)
        assert torch.equal(pack_bits(paths_to_stream(states, tcq.kv)).reshape(codes.shape), codes)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([n for n in TRELLIS if PALETTE[n].family == "tcq"]), st.integers(0, 2**32 - 1))
def test_tcq_encoder_words_decode_to_the_encoder_paths(name, seed):
    """The stored words of a real TCQ encode (one 16×16 tile) read back as the Viterbi path."""
    q = get_quantizer(name)
    x = torch.randn(TILE, TILE, generator=torch.Generator().manual_seed(seed)) * 0.87
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-tile Viterbi: 2 threads only add contention (10× slower on a busy box)
    try:
        codes = q.encode(x)["codes"]
        paths = quantize_tiles(to_tiles(x).reshape(-1, TILE * TILE), q.table(x.device), q.kv)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(words_to_states(codes.reshape(-1, codes.shape[-1]), q.kv), paths)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SCALAR_VECTOR), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_nuq_and_vq_codes_survive_decode_then_encode(name, row_tiles, col_tiles, seed):
    """Re-encoding a reconstruction gives the same codes (no two codebook entries coincide)."""
    q = get_quantizer(name)
    shape = (TILE * row_tiles, TILE * col_tiles)
    tensors = q.random_tensors(*shape, torch.Generator().manual_seed(seed))
    assert torch.equal(q.encode(q.decode(tensors, shape))["codes"], tensors["codes"])


# -- 3. the runtime lane-major layout -----------------------------------------------------------
@st.composite
def entry_and_shape(draw):
    name = draw(st.sampled_from(ENTRIES))
    q = get_quantizer(name)
    rows = TILE * draw(st.integers(1, 8))
    step = 2 * TILE if q.family == "half-tcq" else TILE
    cols = step * draw(st.integers(1, 256 // step))
    q.check_shape(rows, cols)
    return name, rows, cols


@settings(max_examples=60, deadline=None)
@given(entry_and_shape(), st.integers(0, 2**32 - 1))
@example(("half-tcq-3.25", 128, 256), 0)
@example(("nuq-8", 16, 16 * 9), 1)
def test_lanes_unpack_of_pack_is_the_identity(shape, seed):
    name, rows, cols = shape
    tensors = get_quantizer(name).random_tensors(rows, cols, torch.Generator().manual_seed(seed))
    packed = lanes.pack(name, tensors)
    for key in lanes.code_names(name):
        rt, ct, w = tensors[key].shape
        assert packed[key].shape == (rt, lanes.groups(ct), 32 * lanes.group_words(w))
        assert packed[key].dtype == torch.int32
        assert _popcount(packed[key]) == _popcount(tensors[key])  # a bit permutation, zero padding
    back = lanes.unpack(name, packed, (rows, cols))
    assert set(back) == set(tensors)
    for key in tensors:
        assert back[key].dtype == tensors[key].dtype
        assert torch.equal(back[key], tensors[key])


TILE_WORDS = sorted({PALETTE[n].code_words_per_tile() for n in ENTRIES if PALETTE[n].family != "half-tcq"}
                    | {t.code_words_per_tile() for n in TRELLIS for _, t in _tcq_parts(n)})


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.integers(1, 20), st.sampled_from(TILE_WORDS), st.integers(0, 2**32 - 1))
@example(lanes.ROW_TILES_A_CHUNK + 1, 9, 12, 0)
def test_lanes_pack_codes_round_trips_across_row_chunks(rt, ct, w, seed):
    """Up to 40 row tiles: crosses the ROW_TILES_A_CHUNK boundary the load-time repack uses."""
    c = torch.randint(-(2**31), 2**31, (rt, ct, w), generator=torch.Generator().manual_seed(seed),
                      dtype=torch.int64).to(torch.int32)
    packed = lanes.pack_codes(c)
    assert packed.shape == (rt, lanes.groups(ct), 32 * lanes.group_words(w))
    assert torch.equal(lanes.unpack_codes(packed, ct, w), c)


# -- 4. plan documents -------------------------------------------------------------------------
_floats = st.floats(allow_nan=False, width=64)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _floats | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
_free = st.dictionaries(st.text(max_size=8), _json, max_size=4)
_names = st.text(min_size=1, max_size=12)


@st.composite
def plans(draw):
    layer_names = draw(st.lists(_names, min_size=0, max_size=4, unique=True))
    layers = {
        n: PlanLayer(
            quantizer=draw(st.sampled_from(ENTRIES)), family=draw(st.text(max_size=8)), bits=draw(_floats),
            shape=draw(st.lists(st.integers(0, 2**20), min_size=2, max_size=2)), block=draw(st.integers(0, 999)),
            kind=draw(st.text(max_size=5)), group=draw(st.text(max_size=6)), bytes=draw(st.integers(0, 2**40)),
            a=draw(_floats), err=draw(_floats), loss=draw(_floats), ideal_bits=draw(_floats),
        )
        for n in layer_names
    }
    group = st.builds(PlanGroup, group=st.text(max_size=6), quantizer=st.sampled_from(ENTRIES),
                      layers=st.lists(_names, max_size=3), latency_s=st.none() | _floats)
    blocks = draw(st.lists(st.builds(PlanBlock, block=st.integers(0, 999), groups=st.lists(group, max_size=3),
                                     latency_s=st.none() | _floats), max_size=3))
    budgets = draw(st.lists(st.builds(Budget, kind=st.sampled_from(["bits", "bytes", "latency"]),
                                      value=st.integers(1, 2**40) | _floats, text=st.text(max_size=10)),
                            min_size=1, max_size=3))
    return Plan(
        model=draw(_free), budgets=budgets, options=draw(_free), totals=draw(_free), bound=draw(_free),
        solver=draw(_free), codebooks=draw(st.lists(st.text(max_size=8), max_size=3)), layers=layers,
        blocks=blocks, provenance=draw(_free), notes=draw(st.lists(st.text(max_size=20), max_size=3)),
    )


def _assert_plan_round_trips(p: Plan) -> None:
    d = p.to_dict()
    assert d["format"] == PLAN_FORMAT
    assert Plan.from_dict(d) == p
    assert Plan.from_dict(json.loads(json.dumps(d))) == p
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        p.save(path)
        text = path.read_text()
        loaded = Plan.load(path)
    assert loaded == p
    assert loaded.to_dict() == d
    assert list(loaded.to_dict()) == list(d)  # key order kept
    assert json.dumps(loaded.to_dict(), indent=1) + "\n" == text  # saving again writes the same bytes


@settings(max_examples=60, deadline=None)
@given(plans())
def test_synthetic_plan_round_trips_through_dict_and_file(p):
    _assert_plan_round_trips(p)


@settings(max_examples=5, deadline=None)
@given(
    st.integers(200, 475).map(lambda c: c / 100),
    st.lists(st.sampled_from(["nuq", "vq", "tcq", "half-tcq"]), min_size=1, max_size=4, unique=True),
)
def test_planned_plan_round_trips_through_dict_and_file(bits, families):
    """Real plans on the Llama-3.1-8B reference inputs (about 1 s each)."""
    from qpalette.planning.planner import plan

    p = plan(str(REF / "llama31_8b"), [f"{bits}bits"], sensitivity=str(REF / "llama31_8b_sensitivity.json"),
             palette=[",".join(families)])
    assert {v.family for v in p.layers.values()} <= set(families)
    assert p.totals["avg_bits"] <= bits + 1e-9
    _assert_plan_round_trips(p)


# -- 5. Hadamard transform, tiles, sign vectors ------------------------------------------------
def _supported(n: int) -> bool:
    try:
        decompose(n)
    except UnsupportedShape:
        return False
    return True


HADAMARD_SIZES = [n for n in range(1, 2**15 + 1) if _supported(n)]  # 665 sizes: K·2^m, K ≤ 1024
DENSE_ORDERS = sorted({decompose(n)[0] for n in HADAMARD_SIZES} | {2, 4, 8, 16})


def test_supported_sizes_include_the_model_sizes():
    """Guards the enumeration the properties below draw from."""
    for n in (576, 1536, 11008, 14336, 28672, 4096, 64, 1):
        assert n in HADAMARD_SIZES
    assert 116 in {k for k in range(1, 1025) if not _supported(k)}


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(HADAMARD_SIZES), st.integers(1, 3), st.integers(0, 2**32 - 1))
@example(576, 2, 0)
@example(1536, 2, 0)
@example(14336, 1, 0)  # 28·512
@example(11008, 1, 0)  # 344·32
@example(28672, 1, 0)  # 28·1024
def test_hadamard_transform_is_orthogonal_and_its_transpose_inverts_it(n, batch, seed):
    k, p2 = decompose(n)
    assert k * p2 == n and p2 & (p2 - 1) == 0
    x = torch.randn(batch, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y = hadamard_transform(x)
    assert y.shape == x.shape
    # orthogonal: norms and inner products are kept
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-9, atol=0)
    scale = x.norm(dim=-1).max() ** 2
    assert ((y @ y.T) - (x @ x.T)).abs().max() <= 1e-9 * scale
    back = hadamard_transform(y, transpose=True)
    assert (back - x).norm(dim=-1).max() <= 1e-9 * x.norm(dim=-1).min()
    # and Hᵀ is also a right inverse
    assert (hadamard_transform(hadamard_transform(x, transpose=True)) - x).norm() <= 1e-9 * x.norm()
    x32 = x.float()
    back32 = hadamard_transform(hadamard_transform(x32), transpose=True)
    assert (back32 - x32).norm(dim=-1).max() <= 1e-5 * x32.norm(dim=-1).min()


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(DENSE_ORDERS))
def test_every_dense_factor_is_a_hadamard_matrix(k):
    """H_K H_Kᵀ = K·I exactly, with ±1 entries, for every order decompose() may pick."""
    h = hadamard_matrix(k)
    assert set(np.unique(h).tolist()) <= {-1, 1}
    assert np.array_equal(h @ h.T, k * np.eye(k, dtype=np.int64))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([n for n in HADAMARD_SIZES if n % 8 == 0 and n <= 8192]), st.integers(0, 2**32 - 1))
def test_rotation_and_sign_packing_invert(n, seed):
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    packed = pack_signs(signs)
    assert packed.dtype == torch.uint8 and packed.numel() == n // 8
    assert torch.equal(unpack_signs(packed), signs)
    w = torch.randn(3, n, generator=g)
    back = unrotate_weight(rotate_weight(w, signs), signs)
    assert (back - w).norm(dim=-1).max() <= 1e-5 * w.norm(dim=-1).min()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_to_tiles_then_from_tiles_is_the_identity(row_tiles, col_tiles, seed):
    w = torch.randn(TILE * row_tiles, TILE * col_tiles, generator=torch.Generator().manual_seed(seed))
    t = to_tiles(w)
    assert t.shape == (row_tiles, col_tiles, TILE * TILE)
    assert torch.equal(from_tiles(t), w)
    # each tile holds exactly its own 256 weights
    tile = w[:TILE, :TILE].reshape(-1)
    assert torch.equal(t[0, 0].sort().values, tile.sort().values)


def test_bit_widths_cover_the_palette():
    """The drawn widths/kv values include every width the palette packs with."""
    widths = {getattr(PALETTE[n], "width", None) for n in SCALAR_VECTOR}
    assert widths <= set(range(1, 33))
    assert KVS == list(range(2, 11))
    assert reduce(math.gcd, TILE_WORDS) % 4 == 0  # group_words needs W divisible by 4


@pytest.mark.parametrize("shape", [(0, 32), (32, 0), (0, 0)])
def test_zero_sized_matrices_are_refused_clearly(shape):
    """Found by the properties above: a zero dimension passed the tiling check and crashed deep in
    the packing code; it is now an UnsupportedShape naming the shape."""
    for name in ("nuq-4", "vq-2.0", "tcq-2.0"):
        with pytest.raises(UnsupportedShape, match="positive multiples"):
            get_quantizer(name).check_shape(*shape)
