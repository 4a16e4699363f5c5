"""CUDA kernels against the pure-PyTorch reference (run with `pytest -m gpu` on a CUDA machine).

Fresh random data every check: random int32 code words (any words are a valid stream of every
format, TCQ included) regrouped into the runtime's lane-major layout, random fp16 row scales and
activations. The memory the kernels write into held NaN just before, so an element nothing wrote
fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from qpalette.quant.hadamard import decompose
from qpalette.quant.incoherence import pack_signs, random_signs, rotate_input, unpack_signs
from qpalette.quant.palette import PALETTE, get_quantizer
from qpalette.runtime import kernel_build as kernels
from qpalette.runtime import lanes, ops

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
# (out, in): non-powers of two in both positions (576 = 36 tiles: a padded last group), tiny ones
# (fewer groups than warps), the Llama shapes' large dimension on either side (in = 14336: clusters
# of 4 CTAs), and in = 28672 (clusters of 8)
SHAPES = [(576, 1536), (1536, 576), (32, 64), (16, 32), (14336, 576), (576, 14336), (1024, 4096), (256, 28672)]
BATCHES = range(1, 10)
TOL = 1e-2


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return kernels.extension()


def random_tensors(name: str, rows: int, cols: int, gen: torch.Generator):
    """(checkpoint tensors, runtime tensors) on the GPU."""
    stored = {k: v.cuda() for k, v in get_quantizer(name).random_tensors(rows, cols, gen).items()}
    return stored, lanes.pack(name, stored)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.double()
    ref = ref.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison(shape, dtype):
    """Fill a block of the caching allocator with NaN and free it: the kernel's output of the same
    size, allocated next, lands there."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def run_fused(ext, name, x2, tensors, rows, pdl=True, signs=None, num_sms=None, gated=False, norm=None,
              y_add=None):
    """The fused GEMV straight through the extension (None: it does not take this shape); `num_sms`
    fewer than the GPU's: fewer CTAs, each owning more row tiles; `gated`: x2 = [gate | up]; `norm`
    = (weight, eps, x_add, h_out) for add + RMSNorm in the prologue; `y_add` added to y."""
    spec = ops.kernel_spec(name)
    a, b = ops.code_tensors(name, tensors)
    poison((x2.shape[0], rows), x2.dtype)
    k = decompose(x2.shape[1] // (2 if gated else 1))[0] if signs is not None else 1
    hk = ops._hadamard_row_masks(k, x2.device) if k > 1 else None
    return ext.gemv(x2, a, b, tensors["row_scale"], ops.lut(name, x2.dtype, x2.device), ext.FAMILY_CODES[spec.family],
                    spec.p0, spec.p1, rows, torch.cuda.current_stream().cuda_stream,
                    num_sms or torch.cuda.get_device_properties(0).multi_processor_count, pdl, signs, hk, k, gated,
                    *(norm or (None, 0.0, None, None)), y_add)


def one_cta_takes(cols: int) -> bool:
    """Whether one CTA (16 warps of 2 groups of 128 columns) holds all of K: wider inputs need a
    thread-block cluster, which only Hopper (sm_90+) has; elsewhere such a fused launch declines."""
    return cols <= 16 * 2 * 128 or torch.cuda.get_device_capability()[0] >= 9


def run_dequant(ext, name, tensors, shape, dtype):
    spec = ops.kernel_spec(name)
    a, b = ops.code_tensors(name, tensors)
    poison(shape, dtype)
    return ext.dequant(a, b, tensors["row_scale"], ops.lut(name, dtype, a.device), ext.FAMILY_CODES[spec.family],
                       spec.p0, spec.p1, shape[0], shape[1], dtype, torch.cuda.current_stream().cuda_stream,
                       torch.cuda.get_device_properties(0).multi_processor_count)


@pytest.mark.parametrize("name", list(PALETTE))
def test_fused_matmul_every_entry(ext, name):
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    worst = {}
    for rows, cols in SHAPES:
        if get_quantizer(name).family == "half-tcq" and cols % 32:
            continue
        stored, tensors = random_tensors(name, rows, cols, gen)
        w = ops.dequantize(name, stored, (rows, cols))  # float32 reference on the GPU
        for dtype in DTYPES:
            for m in BATCHES:
                x = torch.randn(m, cols, generator=gen).to(dtype).cuda()
                ref = x.float() @ w.T
                if m <= ops.FUSED_MAX_ROWS:
                    y = run_fused(ext, name, x, tensors, rows, pdl=m % 2 == 1)
                    assert y is not None, f"the GEMV refused {rows}x{cols}"
                else:
                    y = x @ run_dequant(ext, name, tensors, (rows, cols), dtype).T
                torch.cuda.synchronize()
                worst[(rows, cols, str(dtype), m)] = rel_err(y, ref)
                # the op the layers call, with leading dimensions
                y2 = ops.quantized_matmul(x.reshape(1, m, cols), name, tensors, (rows, cols))
                assert y2.shape == (1, m, rows) and y2.dtype == dtype
                worst[(rows, cols, str(dtype), m, "op")] = rel_err(y2.reshape(m, rows), ref)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{name}: relative error above {TOL}: {bad}"


@pytest.mark.parametrize("name", ["tcq-2.0", "half-tcq-3.25", "nuq-4", "vq-2.0"])
def test_ctas_owning_several_row_tiles_of_a_narrow_matrix(ext, name):
    """Few CTAs (as when an expert launch shares the SMs among its slots), each with more row
    tiles than a narrow input gives it warps: every row tile is still reduced and written."""
    gen = torch.Generator().manual_seed(3)
    for rows, cols in [(256, 256), (512, 128), (96, 512)]:
        stored, tensors = random_tensors(name, rows, cols, gen)
        w = ops.dequantize(name, stored, (rows, cols))
        for m in (1, 3):
            x = torch.randn(m, cols, generator=gen).half().cuda()
            for num_sms in (1, 5):
                y = run_fused(ext, name, x, tensors, rows, num_sms=num_sms)
                assert rel_err(y, x.float() @ w.T) <= TOL, (rows, cols, m, num_sms)


@pytest.mark.parametrize("name", ["tcq-2.0", "half-tcq-3.25", "nuq-4", "vq-2.0"])
def test_a_cluster_owning_many_row_tiles(ext, name):
    """K split over a cluster whose CTAs own more row tiles than one flush of the cluster sums
    holds (qpalette_gemv.cuh: flush_cluster): the sums of every flush land, none is overwritten
    before rank 0 has read it. Few SMs force few clusters (in = 14336: clusters of 4, 28672: of 8)."""
    gen = torch.Generator().manual_seed(5)
    for rows, cols in [(576, 14336), (256, 28672)]:
        stored, tensors = random_tensors(name, rows, cols, gen)
        w = ops.dequantize(name, stored, (rows, cols))
        for m in (1, 8):
            x = torch.randn(m, cols, generator=gen).half().cuda()
            for num_sms in (4, 8, 16):
                y = run_fused(ext, name, x, tensors, rows, num_sms=num_sms)
                assert rel_err(y, x.float() @ w.T) <= TOL, (rows, cols, m, num_sms)


@pytest.mark.parametrize("name", ["tcq-2.0", "nuq-4", "vq-4.0", "half-tcq-3.25", "nuq-8", "vq-6.0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernel(ext, name, dtype):
    gen = torch.Generator().manual_seed(7)
    rows, cols = 1536, 576
    stored, tensors = random_tensors(name, rows, cols, gen)
    w = run_dequant(ext, name, tensors, (rows, cols), dtype)
    ref = ops.dequantize(name, stored, (rows, cols))
    assert rel_err(w, ref) <= 4e-3


@pytest.mark.parametrize("name", ["tcq-2.0", "tcq-3.0", "half-tcq-3.25", "nuq-4", "vq-2.0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotation_fused_into_the_gemv(ext, name, dtype):
    """rotated_matmul (H(s ⊙ x) in the GEMV's prologue) against rotate-then-matmul in float32,
    for the sizes it fuses (powers of two, and K·2^m split over a cluster: 14336 = 28·512 over 4
    CTAs, 1536 = 12·128 in one); other sizes fall back to the separate rotation."""
    gen = torch.Generator().manual_seed(11)
    for rows, cols in [(1024, 4096), (256, 128), (96, 2048), (64, 8192), (48, 576), (64, 14336), (32, 1536),
                       (48, 6144)]:
        stored, tensors = random_tensors(name, rows, cols, gen)
        signs = pack_signs(random_signs(cols, seed=cols)).cuda()
        w = ops.dequantize(name, stored, (rows, cols))
        for m in BATCHES:
            x = torch.randn(m, cols, generator=gen).to(dtype).cuda()
            ref = ops.rotate_reference(x.float(), signs).to(dtype).float() @ w.T
            poison((m, rows), dtype)
            y = ops.rotated_matmul(x, signs, name, tensors, (rows, cols))
            assert rel_err(y, ref) <= TOL, (rows, cols, m)
            if m <= ops.FUSED_MAX_ROWS:
                fused = run_fused(ext, name, x, tensors, rows, signs=signs)
                expect = ops.gemv_rotates_entry(name, cols) and one_cta_takes(cols)  # whole groups
                assert (fused is not None) == expect, (rows, cols)


# entries whose GEMV forms the gated input itself (not half-TCQ, words ≤ 12: Pair::FORMS_INPUT); the
# others fall back to the elementwise product + the fused rotation
@pytest.mark.parametrize("name, fuses", [("tcq-2.0", True), ("tcq-4.0", True), ("nuq-4", True), ("vq-2.0", True),
                                         ("half-tcq-3.25", False), ("nuq-8", False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_input_formed_in_the_gemv(ext, name, fuses, dtype):
    """gated_rotated_matmul (silu(gate) ⊙ up, then H(s ⊙ ·), in the GEMV's prologue) against the
    product rounded to the dtype, rotated and multiplied in float32: K = 1 sizes and K·2^m ones
    (14336 = 28·512 over a cluster of 4, 1536 = 12·128), batches 1–9 (9: the dequantize path)."""
    assert ops.gemv_forms_input(name) == fuses  # the Python mirror of the kernels' rule
    gen = torch.Generator().manual_seed(12)
    for rows, cols in [(1024, 4096), (256, 128), (64, 14336), (32, 1536)]:
        stored, tensors = random_tensors(name, rows, cols, gen)
        signs = pack_signs(random_signs(cols, seed=cols)).cuda()
        w = ops.dequantize(name, stored, (rows, cols))
        for m in BATCHES:
            gu = torch.randn(m, 2 * cols, generator=gen).to(dtype).cuda()
            h = ops.silu_mul_reference(gu.float()).to(dtype)
            ref = ops.rotate_reference(h.float(), signs).to(dtype).float() @ w.T
            poison((m, rows), dtype)
            y = ops.gated_rotated_matmul(gu, signs, name, tensors, (rows, cols))
            assert rel_err(y, ref) <= TOL, (rows, cols, m)
            if m <= ops.FUSED_MAX_ROWS:
                fused = run_fused(ext, name, gu, tensors, rows, signs=signs, gated=True)
                assert (fused is not None) == (fuses and one_cta_takes(cols)), (rows, cols)
                if fused is not None:
                    assert rel_err(fused, ref) <= TOL, (rows, cols, m)
                    res = torch.randn(m, rows, generator=gen).to(dtype).cuda()  # the epilogue's residual add:
                    added = run_fused(ext, name, gu, tensors, rows, signs=signs, gated=True, y_add=res)
                    assert torch.equal(added, fused + res), (rows, cols, m)  # y rounded, + r, rounded again
            res = torch.randn(m, rows, generator=gen).to(dtype).cuda()
            y_res = ops.gated_rotated_matmul(gu, signs, name, tensors, (rows, cols), residual=res)
            assert rel_err(y_res, ref + res.float()) <= TOL, (rows, cols, m)


# K = 1 sizes take the norm in the GEMV (one CTA holds the row: 4096 = 16 warps × 2 groups × 128);
# 1536 (K = 12) and 8192 (two CTAs) fall back to the norm in torch + the fused rotation
@pytest.mark.parametrize("name, fuses", [("tcq-2.0", True), ("nuq-4", True), ("vq-2.0", True),
                                         ("half-tcq-3.25", False), ("nuq-8", False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_and_rms_norm_formed_in_the_gemv(ext, name, fuses, dtype):
    """normed_rotated_matmul (x + residual, written out; LlamaRMSNorm; H(s ⊙ ·); in the GEMV's
    prologue) against torch's add and norm in the dtype, rotated and multiplied in float32; with and
    without the residual, batches 1–9 (9: the dequantize path), large activations (a residual stream)."""
    gen = torch.Generator().manual_seed(13)
    for rows, cols in [(1024, 4096), (256, 128), (48, 512), (32, 1536), (64, 8192)]:
        stored, tensors = random_tensors(name, rows, cols, gen)
        signs = pack_signs(random_signs(cols, seed=cols)).cuda()
        w = ops.dequantize(name, stored, (rows, cols))
        weight = (torch.rand(cols, generator=gen) + 0.5).to(dtype).cuda()
        takes = fuses and ops.gemv_norms(cols)
        for m in BATCHES:
            x = (torch.randn(m, cols, generator=gen) * 20).to(dtype).cuda()
            res = (torch.randn(m, cols, generator=gen) * 20).to(dtype).cuda()
            for residual in (None, res):
                h = x if residual is None else x + residual
                normed = ops.rms_norm_reference(h, weight, 1e-5)
                ref = ops.rotate_reference(normed.float(), signs).to(dtype).float() @ w.T
                poison((m, rows), dtype)
                y, h_out = ops.normed_rotated_matmul(x, weight, 1e-5, signs, name, tensors, (rows, cols), residual)
                assert rel_err(y, ref) <= TOL, (rows, cols, m)
                assert (h_out is None) == (residual is None) and (h_out is None or torch.equal(h_out, h))
                if m <= ops.FUSED_MAX_ROWS:
                    h_fused = torch.full_like(x, float("nan")) if residual is not None else None
                    fused = run_fused(ext, name, x, tensors, rows, signs=signs, norm=(weight, 1e-5, residual, h_fused))
                    assert (fused is not None) == takes, (rows, cols)
                    if fused is not None:
                        assert rel_err(fused, ref) <= TOL, (rows, cols, m)
                        assert h_fused is None or torch.equal(h_fused, h)


def test_every_entry_has_a_kernel(ext):
    for name in PALETTE:
        assert ops.kernel_spec(name).family in ext.FAMILY_CODES


@pytest.mark.parametrize("n", [64, 128, 576, 1536, 4096, 6144, 8192, 11008, 14336, 28672])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pdl", [False, True])
def test_hadamard_kernel(ext, n, dtype, pdl):
    """Both kernels (segments mixed first for K ≤ 64 and 2^m ≤ 4096, else whole rows per block)
    against the float64 reference, launched with and without programmatic dependent launch."""
    gen = torch.Generator().manual_seed(n)
    signs = pack_signs(random_signs(n, seed=n)).cuda()
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, n, generator=gen).to(dtype).cuda()
        ref = rotate_input(x.double().cpu(), unpack_signs(signs.cpu()).double())
        k, p2 = decompose(n)
        hk = ops._hadamard_factor(k, x.device) if k > 1 else None
        out = torch.full_like(x, float("nan"))
        ext.hadamard(x, signs, hk, k, p2, torch.cuda.current_stream().cuda_stream,
                     torch.cuda.get_device_properties(0).multi_processor_count, pdl, out)
        assert rel_err(out.cpu(), ref) <= TOL
        y = ops.rotate(x.reshape(rows, 1, n), signs)
        assert y.shape == (rows, 1, n) and y.dtype == dtype
        assert rel_err(y.reshape(rows, n).cpu(), ref) <= TOL


# gated K > 1 sizes mix on the tensor cores (hadamard_gated_mma_kernel): 768 = 12·64 (2^m = 64, padding
# threads), 1536 = 12·128 (one k-step), 7168 = 28·256 (14 segments a block: A's rows g + 8), 10240 = 20·512
# (blocks of 7, 7 and 6 segments), 14336 = 28·512 (down); 6144 = 12·512 does not fit there (64 tiles of 8
# columns for 12 warps) and keeps the rows kernel's scalar mix
@pytest.mark.parametrize("n", [64, 512, 768, 1536, 4096, 6144, 7168, 10240, 14336])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_kernel_forms_its_input(ext, n, dtype):
    """hadamard_formed (the rows kernel forming silu(gate) ⊙ up, or x + residual → RMSNorm, as it
    loads; for gated K > 1 sizes the gated mma kernel) against the input formed by the references in
    the dtype and rotated in float64; the sum written out; a norm of a K > 1 size (its segments'
    blocks would each need the whole row) and a size past the rows kernel are declined (None)."""
    gen = torch.Generator().manual_seed(n + 1)
    signs = pack_signs(random_signs(n, seed=n)).cuda()
    k, p2 = decompose(n)
    hk = ops._hadamard_factor(k, signs.device) if k > 1 else None
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype).cuda()
    stream, sms = torch.cuda.current_stream().cuda_stream, torch.cuda.get_device_properties(0).multi_processor_count

    def formed(x, gated=False, norm=(None, 0.0, None, None)):
        return ext.hadamard_formed(x, signs, hk, k, p2, stream, sms, True, gated, *norm)

    def rotated(h):
        return rotate_input(h.double().cpu(), unpack_signs(signs.cpu()).double())

    for rows in (1, 3, 8, 33):
        gu = torch.randn(rows, 2 * n, generator=gen).to(dtype).cuda()
        assert rel_err(formed(gu, gated=True).cpu(), rotated(ops.silu_mul_reference(gu.float()).to(dtype))) <= TOL
        x = (torch.randn(rows, n, generator=gen) * 20).to(dtype).cuda()
        res = (torch.randn(rows, n, generator=gen) * 20).to(dtype).cuda()
        for residual in (None, res):
            h_out = torch.full_like(x, float("nan")) if residual is not None else None
            y = formed(x, norm=(weight, 1e-5, residual, h_out))
            assert (y is None) == (k > 1), n
            if y is not None:
                h = x if residual is None else x + residual
                assert rel_err(y.cpu(), rotated(ops.rms_norm_reference(h, weight, 1e-5))) <= TOL
                assert h_out is None or torch.equal(h_out, h)
    assert ext.hadamard_formed(torch.zeros(1, 2 * 8192 * 4, dtype=dtype, device="cuda"),
                               pack_signs(random_signs(8192 * 4, seed=0)).cuda(), None, 1, 8192 * 4,
                               stream, sms, True, True, None, 0.0, None, None) is None


def test_hadamard_formed_rejects_inconsistent_inputs(ext):
    """hadamard_formed's argument checks: a residual needs h_out and a norm (and h_out a residual),
    gated and normed together, an odd gated width and a wrongly shaped residual are errors, not
    launches."""
    n, rows = 512, 3
    signs = pack_signs(random_signs(n, seed=0)).cuda()
    stream, sms = torch.cuda.current_stream().cuda_stream, torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(rows, n, device="cuda", dtype=torch.float16)
    weight = torch.ones(n, device="cuda", dtype=torch.float16)
    res, h_out = torch.randn_like(x), torch.empty_like(x)

    def formed(x, gated, norm):
        return ext.hadamard_formed(x, signs, None, 1, n, stream, sms, True, gated, *norm)

    assert formed(x, False, (weight, 1e-5, res, h_out)) is not None
    bad = {
        "residual without h_out": (x, False, (weight, 1e-5, res, None)),
        "h_out without residual": (x, False, (weight, 1e-5, None, h_out)),
        "residual without norm": (x, False, (None, 0.0, res, h_out)),
        "gated and normed": (torch.cat([x, x], 1), True, (weight, 1e-5, None, None)),
        "odd gated width": (x[:, :-1].contiguous(), True, (None, 0.0, None, None)),
        "residual of another shape": (x, False, (weight, 1e-5, res[:1].contiguous(), h_out)),
    }
    for what, (xi, gated, norm) in bad.items():
        with pytest.raises(RuntimeError):
            formed(xi, gated, norm)
            pytest.fail(what)


def _layer(name, rows, cols, gen):
    stored, tensors = random_tensors(name, rows, cols, gen)
    signs = pack_signs(random_signs(cols, seed=1)).cuda()

    def f(x):
        return ops.quantized_matmul(ops.rotate(x, signs), name, tensors, (rows, cols))

    def ref(x):
        xr = ops.rotate_reference(x.float(), signs)
        return xr @ ops.dequantize(name, stored, (rows, cols)).T

    return f, ref


@pytest.mark.parametrize("name", ["tcq-3.0", "half-tcq-2.75", "nuq-6"])
def test_torch_compile(ext, name):
    gen = torch.Generator().manual_seed(3)
    f, ref = _layer(name, 1536, 576, gen)
    compiled = torch.compile(f, fullgraph=True)
    for m in (1, 4, 9):
        x = torch.randn(m, 576, generator=gen).half().cuda()
        assert rel_err(compiled(x), ref(x)) <= TOL


@pytest.mark.parametrize("name", ["tcq-2.0", "half-tcq-3.25", "vq-3.0"])
@pytest.mark.parametrize("m", [1, 5, 8, 12])
def test_cuda_graph_capture(ext, name, m):
    gen = torch.Generator().manual_seed(4)
    f, ref = _layer(name, 576, 1536, gen)
    x = torch.randn(m, 1536, generator=gen).to(torch.bfloat16).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f(x)  # warm-up: builds the kernels, uploads the tables
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = f(x)
    for _ in range(3):
        x.copy_(torch.randn(m, 1536, generator=gen).to(torch.bfloat16))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, ref(x)) <= TOL


def test_compile_reduce_overhead(ext):
    """torch.compile with CUDA graphs (mode reduce-overhead) over rotate + matmul."""
    gen = torch.Generator().manual_seed(5)
    f, ref = _layer("tcq-4.0", 576, 1536, gen)
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        x = torch.randn(2, 1536, generator=gen).half().cuda()
        assert rel_err(compiled(x).clone(), ref(x)) <= TOL
