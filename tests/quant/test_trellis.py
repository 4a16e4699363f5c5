import pytest
import torch

from qpalette.quant.bitpack import pack_bits, unpack_bits
from qpalette.quant.codebooks import TCQ_LUT_STD, codebook
from qpalette.quant.palette.tcq import TCQ
from qpalette.quant.trellis import (
    NUM_STATES,
    STEPS,
    _viterbi,
    lut_bits,
    paths_to_stream,
    quantize_tiles,
    state_values,
    stream_to_states,
    words_to_states,
)

KVS = list(range(2, 11))  # TCQ 1.0 ... 5.0 bits


def path_cost(x, values, path):
    return (values[path] - x).pow(2).sum(dim=(-1, -2))


def naive_viterbi_cost(x, values, kv):
    """Optimal free-end path cost, enumerating each state's 2^kv predecessors explicitly."""
    s = torch.arange(NUM_STATES)
    preds = (torch.arange(1 << kv)[None, :] << (16 - kv)) | (s[:, None] >> kv)  # (S, 2^kv)
    cost = (values - x[0]).pow(2).sum(-1).double()
    for t in range(1, STEPS):
        cost = cost[preds].min(dim=1).values + (values - x[t]).pow(2).sum(-1).double()
    return cost.min()


@pytest.mark.parametrize("kv", [2, 4, 6])
def test_viterbi_matches_naive_dynamic_program(kv):
    g = torch.Generator().manual_seed(kv)
    table = codebook(f"tcq.q{lut_bits(kv)}")
    values = state_values(table)
    x = torch.randn(2, STEPS, 2, generator=g) * 0.87
    path = _viterbi(x, values, kv, None)
    for i in range(2):
        assert path_cost(x[i], values, path[i]).item() == pytest.approx(
            naive_viterbi_cost(x[i], values, kv).item(), rel=1e-5
        )


@pytest.mark.parametrize("kv", KVS)
def test_paths_obey_shift_rule_and_wrap(kv):
    g = torch.Generator().manual_seed(100 + kv)
    tiles = torch.randn(3, 256, generator=g) * 0.87
    paths = quantize_tiles(tiles, codebook(f"tcq.q{lut_bits(kv)}"), kv)
    lo_mask = (1 << (16 - kv)) - 1
    # s_{t+1} = ((s_t << kv) & 0xFFFF) | u  ⇔  s_{t+1} >> kv == s_t mod 2^(16−kv)
    assert torch.equal(paths[:, 1:] >> kv, paths[:, :-1] & lo_mask)
    # tail-biting: the window wraps from the last step to the first
    assert torch.equal(paths[:, 0] >> kv, paths[:, -1] & lo_mask)
    # the packed stream holds exactly 128·kv bits and decodes to the same states
    stream = paths_to_stream(paths, kv)
    assert stream.shape[-1] == STEPS * kv
    assert torch.equal(stream_to_states(unpack_bits(pack_bits(stream)), kv), paths)


def test_tail_biting_is_near_free_viterbi():
    """The tail-biting tie costs little: within 6% of the unconstrained optimum (measured ~4%)."""
    kv = 4
    g = torch.Generator().manual_seed(7)
    values = state_values(codebook("tcq.q9"))
    x = torch.randn(8, STEPS, 2, generator=g) * 0.87
    free = path_cost(x, values, _viterbi(x, values, kv, None)).sum()
    tied = path_cost(x, values, quantize_tiles(x.reshape(8, 256), codebook("tcq.q9"), kv)).sum()
    assert free <= tied <= free * 1.06


def test_lut_widths_and_scale():
    assert [lut_bits(kv) for kv in KVS] == [9, 9, 9, 9, 9, 9, 9, 10, 11]
    for q in (9, 10, 11):
        t = codebook(f"tcq.q{q}")
        assert t.shape == (2**q, 2)
        assert t.std().item() == pytest.approx(TCQ_LUT_STD, rel=1e-4)


def test_state_values_follow_hybrid_code():
    t = codebook("tcq.q9")
    v = state_values(t)
    for s in (0, 1, 12345, 65535):
        h = (s * (s + 1)) % 2**16
        idx = (h >> (15 - 9)) & 511
        sign = -1 if h >> 15 else 1
        assert v[s, 0].item() == pytest.approx(sign * t[idx, 0].item())
        assert v[s, 1].item() == pytest.approx(t[idx, 1].item())


def test_viterbi_same_on_cpu_and_device(device):
    q = TCQ(2.0)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    a = q.quantize(w)
    b = q.quantize(w.to(device))
    ha, hb = q.dequantize(a), q.dequantize(b).cpu()
    assert torch.allclose(ha, hb, atol=1e-6) or (ha - hb).abs().gt(1e-6).float().mean() < 0.01


@pytest.mark.parametrize("kv", range(2, 11))
def test_words_to_states_equals_the_bitwise_reading(kv):
    """The fast word-level decode reads the same circular 16-bit windows as the bit stream."""
    g = torch.Generator().manual_seed(kv)
    words = torch.randint(-(2**31), 2**31, (7, 4 * kv), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(words_to_states(words, kv), stream_to_states(unpack_bits(words), kv))


@pytest.mark.parametrize("width", [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
def test_unpack_codes_equals_the_bitwise_reading(width):
    from qpalette.quant.bitpack import from_bits, unpack_codes

    g = torch.Generator().manual_seed(width)
    words = torch.randint(-(2**31), 2**31, (3, 5, 8 * width), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(unpack_codes(words, width), from_bits(unpack_bits(words), width))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", KVS)
def test_viterbi_kernel_finds_the_reference_paths(kv):
    """The CUDA Viterbi (runtime/cuda/viterbi.cu) against the torch reference on fresh random tiles:
    valid tail-biting paths, the same cost (float rounding may break a near-tie either way), and
    the same path on almost every tile."""
    from qpalette.quant.trellis import _tail_biting_paths, kernel_paths

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)
    n = 333  # not a multiple of the persistent grid
    x = (torch.randn(n, STEPS, 2, generator=g) * 0.87).cuda()
    table = codebook(f"tcq.q{lut_bits(kv)}").cuda()
    values = state_values(table)
    fast = kernel_paths(x, table, kv)
    assert fast is not None, "kernels off on a CUDA machine"
    ref = _tail_biting_paths(x, values, kv)
    lo_mask = (1 << (16 - kv)) - 1
    assert torch.equal(fast[:, 1:] >> kv, fast[:, :-1] & lo_mask), seed
    assert torch.equal(fast[:, 0] >> kv, fast[:, -1] & lo_mask), seed
    fc, rc = path_cost(x, values, fast), path_cost(x, values, ref)
    assert torch.allclose(fc, rc, rtol=1e-4, atol=1e-4) or float((fc - rc).abs().gt(1e-3 * rc).float().mean()) < 0.02, seed
    assert float(fc.sum()) <= float(rc.sum()) * (1 + 1e-4), seed
    assert float((fast == ref).all(dim=1).float().mean()) > 0.95, seed


@pytest.mark.gpu
def test_viterbi_kernel_off_runs_the_reference(monkeypatch):
    from qpalette.quant.trellis import kernel_paths

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("QPALETTE_KERNELS", "0")
    assert kernel_paths(torch.zeros(1, STEPS, 2, device="cuda"), codebook("tcq.q9").cuda(), 4) is None
