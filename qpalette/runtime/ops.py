"""The two operations a quantized layer runs: the online rotation and the quantized matmul.

They are torch.library custom ops, `qpalette::rotate`, `qpalette::quantized_matmul` and the two
in one, `qpalette::rotated_matmul` (the GEMV rotates the activations in its prologue; at batch 1
by default, see `fuses_rotation`), `qpalette::gated_rotated_matmul` (a gated MLP's down projection
on [gate | up]: the GEMV also forms silu(gate) ⊙ up, and may add the block's residual to its
output) and `qpalette::normed_rotated_matmul` (the GEMV also adds the residual and applies the
RMSNorm that precede it in a decoder block), with fake implementations so that torch.compile and
CUDA-graph capture see ordinary ops. The matmul takes the runtime tensors: the checkpoint's, code tensors
in the lane-major layout (runtime/lanes.py). Each op has two implementations registered:

- CPU (and any device without kernels): the pure-PyTorch reference — back to the checkpoint
  layout, decode to float32, multiply back the row scales, one matmul; H(s ⊙ x) with the fast
  transform of quant.hadamard;
- CUDA: the kernels of runtime/cuda (the persistent fused dequantize + tensor-core GEMV for up
  to 8 activation rows with all leading dimensions flattened, dequantize + cuBLAS above that or
  for a shape the GEMV cannot split; the online Hadamard kernel). Where they cannot run (float32
  activations, kernels turned off or not built, a size the Hadamard kernel does not take) the
  CUDA implementation runs the reference and says so once.

The GEMV is launched with programmatic dependent launch on Hopper (its prologue overlaps the
previous kernel); `QPALETTE_PDL=0` turns that off. Capturing a CUDA graph needs one eager call per
(device, quantizer, dtype) first, as usual: that call builds the kernels and uploads the tables.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from qpalette.errors import UnsupportedShape
from qpalette.quant.codebooks import codebook
from qpalette.quant.hadamard import decompose, hadamard_matrix
from qpalette.quant.incoherence import rotate_input, unpack_signs, unrotate_weight
from qpalette.quant.palette import QuantizedMatrix, get_quantizer
from qpalette.runtime import kernel_build, lanes

FUSED_MAX_ROWS = 8          # activation rows the fused kernel takes (mma n = 8)
FUSED_ROTATION_MAX_P2 = 4096  # the power-of-two factor of the inputs the GEMV rotates itself (8 elements a thread)
FUSED_ROTATION_MAX_K = 64     # and their H_K factor (a load a segment and thread)
HADAMARD_MAX_N = 32768      # row length the Hadamard kernel holds in shared memory (fp32)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


# ---- reference ----------------------------------------------------------------------------------

def rotate_reference(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    return rotate_input(x.float(), unpack_signs(signs)).to(x.dtype)


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) ⊙ up for gu = [gate | up] over the last dimension, in float32, rounded once."""
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu.dtype)


def rms_norm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: statistics in float32, the normalised values rounded to h's dtype,
    then multiplied by the weight."""
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def dequantize(quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """W_r = decode(codes) ⊙ row_scale (float32, rows × cols) from the checkpoint's tensors."""
    q = get_quantizer(quantizer)
    return q.dequantize(QuantizedMatrix(q.name, shape, tensors))


def quantized_matmul_reference(
    x_rot: torch.Tensor, quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]
) -> torch.Tensor:
    """x_rot · W_rᵀ from the runtime (lane-major) tensors."""
    w = dequantize(quantizer, lanes.unpack(quantizer, tensors, shape), shape)
    return (x_rot.float() @ w.T).to(x_rot.dtype)


def expert_matmul_reference(x: torch.Tensor, x_rows: torch.Tensor, members: torch.Tensor,
                            member_tensors: list[tuple], quantizer: str, out_features: int) -> torch.Tensor:
    """Row v = H(s_j ⊙ x[x_rows[v]]) · W_jᵀ for j = members[v] (zeros where j < 0); member j's
    (codes, codes_b, row_scale, signs) runtime tensors in `member_tensors[j]`. Every member on
    every row, kept where it is the row's member: no host readback, like the kernel."""
    xs = x[x_rows]
    y = xs.new_zeros((x_rows.shape[0], out_features))
    for j, (codes, codes_b, row_scale, signs) in enumerate(member_tensors):
        yj = _qmm_reference(rotate_reference(xs, signs), codes, codes_b, row_scale, quantizer, out_features)
        y = torch.where((members == j)[:, None], yj, y)
    return y


# ---- the public calls ---------------------------------------------------------------------------

def code_tensors(quantizer: str, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(codes, second half's codes or None) as the op takes them."""
    if get_quantizer(quantizer).family == "half-tcq":
        return tensors["codes_a"], tensors["codes_b"]
    return tensors["codes"], None


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """H(s ⊙ x) over the last dimension; `signs` bit-packed uint8 (in/8,). Same dtype as x."""
    return torch.ops.qpalette.rotate(x, signs)


FUSED_ROTATION_AUTO_ROWS = 1  # "auto": the GEMV rotates x itself up to this many activation rows


@torch.compiler.assume_constant_result
def _fused_rotation_mode() -> str:
    mode = os.environ.get("QPALETTE_FUSED_ROTATION", "auto")
    return {"1": "on", "0": "off"}.get(mode, "auto")


def fuses_rotation(in_features: int, rows: int) -> bool:
    """Whether a layer calls `rotated_matmul` (the GEMV rotates x itself) for this input size and
    number of activation rows, else one rotation shared by the input group and `quantized_matmul`.
    QPALETTE_FUSED_ROTATION=1 / 0 forces either; the default fuses at batch 1 only, where the
    measurements on the H100 favour it: at batch 8 the fused prologue (its rows split over a
    cluster of CTAs) is no faster than the shared rotation kernel (results/kernels_h100/v6/)."""
    if not gemv_rotates(in_features):
        return False
    mode = _fused_rotation_mode()
    return mode == "on" or (mode == "auto" and rows <= FUSED_ROTATION_AUTO_ROWS)


@torch.compiler.assume_constant_result
def gemv_rotates(n: int) -> bool:
    """Input sizes the GEMV can rotate itself: n = K·2^m with 2^m in 8..4096, K ≤ 64 and whole
    groups of 128 columns (the kernel may still decline a split of K whose CTAs would not hold
    whole segments; the op then rotates separately)."""
    if n < 128 or n % 128 or not _hadamard_ok(n):
        return False
    k, p2 = decompose(n)
    return 8 <= p2 <= FUSED_ROTATION_MAX_P2 and k <= FUSED_ROTATION_MAX_K


def gemv_rotates_entry(quantizer: str, n: int) -> bool:
    """gemv_rotates for one entry: half-TCQ's two code segments each need whole groups of 128
    columns, so its fused rotation takes n divisible by 256 (what the expert GEMV, which cannot
    rotate separately, requires of every launch)."""
    return gemv_rotates(n) and (get_quantizer(quantizer).family != "half-tcq" or n % 256 == 0)


FORMS_INPUT_MAX_WORDS = 12  # Pair::FORMS_INPUT (qpalette_gemv.cuh): that staging needs registers to spare


@torch.compiler.assume_constant_result
def gemv_forms_input(quantizer: str) -> bool:
    """Entries whose GEMV forms its input itself, silu(gate) ⊙ up or add + RMSNorm (Pair::FORMS_INPUT:
    not half-TCQ, ≤ 12 code words a lane and group, i.e. ≤ 6 bits); for the others the ops form it
    in torch first."""
    q = get_quantizer(quantizer)
    if q.family == "half-tcq":
        return False
    (_, _, tile_words), _ = q.tensor_specs(16, 16)["codes"]
    return lanes.group_words(tile_words) <= FORMS_INPUT_MAX_WORDS


@torch.compiler.assume_constant_result
def gemv_norms(n: int) -> bool:
    """Input sizes whose GEMV can apply an RMSNorm itself: a power of two it rotates (K = 1), so
    that one CTA holds the whole row for the sum of squares."""
    return gemv_rotates(n) and decompose(n)[0] == 1


def forms_block_input(quantizer: str, in_features: int, rows: int, norm: bool) -> bool:
    """Whether a decoder block's gated call (down: silu(gate) ⊙ up) or, with `norm`, normed call
    (q/k/v, gate/up: add + RMSNorm) on `rows` activation rows runs with its input formed on the
    kernels: by the GEMV where it rotates x itself (batch 1; entries with `gemv_forms_input`), by
    the rotation kernel otherwise (batch 2–8); a norm needs K = 1 (`gemv_norms`). The one rule
    behind `QuantizedLinear.takes_gated` / `takes_normed` and the planner's `takes_block_fusion`."""
    if rows > FUSED_MAX_ROWS or not gemv_rotates(in_features):
        return False
    if fuses_rotation(in_features, rows) and not gemv_forms_input(quantizer):
        return False
    return not norm or gemv_norms(in_features)


def rotated_matmul(x: torch.Tensor, signs: torch.Tensor, quantizer: str, tensors: dict[str, torch.Tensor],
                   shape: tuple[int, int]) -> torch.Tensor:
    """quantized_matmul(rotate(x, signs), ...) as one op (one kernel on CUDA for batch ≤ 8)."""
    codes, codes_b = code_tensors(quantizer, tensors)
    return torch.ops.qpalette.rotated_matmul(x, signs, codes, codes_b, tensors["row_scale"],
                                             get_quantizer(quantizer).name, shape[0])


def gated_rotated_matmul(gu: torch.Tensor, signs: torch.Tensor, quantizer: str, tensors: dict[str, torch.Tensor],
                         shape: tuple[int, int], residual: torch.Tensor | None = None) -> torch.Tensor:
    """rotated_matmul(silu(gate) ⊙ up, ...) [+ residual] for gu = [gate | up] (..., 2·in): a gated
    MLP's down projection reading the gate/up GEMV's output as it is (one kernel on CUDA for batch
    ≤ 8, no elementwise kernel between the two GEMVs), optionally adding the decoder block's
    residual (..., out) as it writes y (rounded like y + residual). Inference only: no gradient."""
    codes, codes_b = code_tensors(quantizer, tensors)
    return torch.ops.qpalette.gated_rotated_matmul(gu, signs, codes, codes_b, tensors["row_scale"],
                                                   get_quantizer(quantizer).name, shape[0], residual)


def normed_rotated_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, signs: torch.Tensor,
                          quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                          residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rotated_matmul(rms_norm_reference(h, norm_weight, eps), ...), h) with h = x + residual (or x):
    a decoder block's residual add and RMSNorm in the GEMV's prologue (one kernel on CUDA for batch
    ≤ 8 and power-of-two inputs, `gemv_norms`). h is None without a residual. Inference only."""
    codes, codes_b = code_tensors(quantizer, tensors)
    y, h = torch.ops.qpalette.normed_rotated_matmul(x, residual, norm_weight, eps, signs, codes, codes_b,
                                                    tensors["row_scale"], get_quantizer(quantizer).name, shape[0])
    return y, (h if residual is not None else None)


def quantized_matmul(
    x_rot: torch.Tensor, quantizer: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]
) -> torch.Tensor:
    """y = x_rot · W_rᵀ for a rotated activation x_rot (..., in) and the runtime tensors
    (`lanes.pack` of the checkpoint's); returns (..., out) in x's dtype."""
    codes, codes_b = code_tensors(quantizer, tensors)
    return torch.ops.qpalette.quantized_matmul(x_rot, codes, codes_b, tensors["row_scale"],
                                               get_quantizer(quantizer).name, shape[0])


# ---- when the CUDA implementation can use the kernels -----------------------------------------

@torch.compiler.assume_constant_result
def _kernels_ok() -> bool:
    return kernel_build.available()


@functools.lru_cache(maxsize=None)
def _say_reference(reason: str) -> None:
    warnings.warn(f"qpalette: {reason}; running the PyTorch reference path (slow)", stacklevel=4)


def _kernel_dtype(x: torch.Tensor) -> bool:
    if x.dtype in KERNEL_DTYPES:
        return True
    _say_reference(f"{x.dtype} activations on CUDA have no kernels (load the model in float16 or bfloat16)")
    return False


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether the CUDA ops run the kernels for activations like x."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES and _kernels_ok()


def prepare(x: torch.Tensor, quantizer: str | None = None) -> None:
    """Allocate what the CUDA ops keep between calls (tables, Hadamard factor) now, eagerly:
    inside torch.compile's CUDA-graph trees a first allocation would land in the graph pool
    ("tensors in the cudagraph pool not tracked as outputs"). The layers call this on every eager
    call (a few dict lookups); compiled regions skip it. `quantizer` is a canonical palette name
    (a layer's `quantizer.name`)."""
    if torch.compiler.is_compiling() or not uses_kernels(x):
        return
    if quantizer is not None:
        lut(quantizer, x.dtype, x.device)
    elif _hadamard_ok(x.shape[-1]):
        k, _ = decompose(x.shape[-1])
        if k > 1:
            _hadamard_factor(k, x.device)
            if k <= FUSED_ROTATION_MAX_K:
                _hadamard_row_masks(k, x.device)


def _hadamard_ok(n: int) -> bool:
    try:
        decompose(n)
    except UnsupportedShape:
        return False
    return n % 8 == 0 and n <= HADAMARD_MAX_N


# ---- what the kernels need besides the stored tensors ----------------------------------------------

@dataclass(frozen=True)
class KernelSpec:
    family: str  # a key of the extension's FAMILY_CODES (runtime/cuda/bindings.cpp)
    p0: int
    p1: int
    book: str
    kind: str  # "pairs" (E, 2) table as is, "nuq-pairs" product of levels, "scalar" (E,) levels


def kernel_spec(quantizer: str) -> KernelSpec:
    q = get_quantizer(quantizer)
    if q.family == "nuq":
        b = int(q.bits)
        if b <= 5:
            return KernelSpec("pair", 2 * b, 0, q.codebooks[0], "nuq-pairs")
        return KernelSpec("scalar", b, 0, q.codebooks[0], "scalar")
    if q.family == "vq":
        return KernelSpec("pair", q.width, 0, q.codebooks[0], "pairs")
    if q.family == "tcq":
        return KernelSpec("tcq", q.kv, q.table_q, q.codebooks[0], "pairs")
    if q.family == "half-tcq":
        return KernelSpec("half-tcq", q.halves[0].kv, q.halves[0].table_q, q.codebooks[0], "pairs")
    raise ValueError(f"no kernel for {quantizer}")


def table_entries(spec: KernelSpec) -> torch.Tensor:
    """(E, 2) float32 value pairs of the kernel's table (scalar: (level, 0))."""
    book = codebook(spec.book)
    if spec.kind == "pairs":
        return book
    if spec.kind == "nuq-pairs":
        gx, gy = torch.meshgrid(book, book, indexing="ij")  # pair code = (code0 << b) | code1
        return torch.stack((gx.reshape(-1), gy.reshape(-1)), dim=-1)
    return torch.stack((book, torch.zeros_like(book)), dim=-1)


_luts: dict[tuple, torch.Tensor] = {}
_hks: dict[tuple, torch.Tensor] = {}
_sms: dict[int, int] = {}


def _not_capturing(what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"qpalette: {what} must be prepared before CUDA-graph capture; run the op once eagerly first"
        )


def lut(quantizer: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The kernel table: one int32 per entry holding the value pair in `dtype` (x in the low half)."""
    spec = kernel_spec(quantizer)
    key = (spec.book, spec.kind, dtype, device)
    t = _luts.get(key)
    if t is None:
        _not_capturing("the codebook table")
        pairs = table_entries(spec).to(dtype).contiguous()
        t = pairs.view(torch.int32).reshape(-1).to(device)
        _luts[key] = t
    return t


def _hadamard_factor(k: int, device: torch.device) -> torch.Tensor:
    key = (k, device)
    t = _hks.get(key)
    if t is None:
        _not_capturing("the Hadamard factor")
        t = torch.from_numpy(hadamard_matrix(k)).to(torch.int8).contiguous().to(device)
        _hks[key] = t
    return t


def _hadamard_row_masks(k: int, device: torch.device) -> torch.Tensor:
    """H_K's rows as int64 bit masks of their −1 entries (K ≤ 64): what the GEMV's fused rotation reads."""
    key = ("masks", k, device)
    t = _hks.get(key)
    if t is None:
        _not_capturing("the Hadamard factor")
        neg = torch.from_numpy(hadamard_matrix(k) < 0).to(torch.int64)
        masks = (neg << torch.arange(k, dtype=torch.int64)).sum(dim=1)  # bit 63 wraps to the sign: fine
        t = masks.contiguous().to(device)
        _hks[key] = t
    return t


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sms:
        _sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sms[idx]


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


@torch.compiler.assume_constant_result
def _pdl() -> bool:
    return os.environ.get("QPALETTE_PDL", "1") != "0"


_hopper: dict[int, bool] = {}


def _pdl_on(device: torch.device) -> bool:
    """Programmatic dependent launch for the rotation kernel: Hopper or newer (the GEMV's launcher
    checks the device itself)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _hopper:
        _hopper[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _pdl() and _hopper[idx]


# ---- custom ops: the reference for every device, the kernels for CUDA ----------------------------

@torch.library.custom_op("qpalette::rotate", mutates_args=())
def _rotate_op(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    return rotate_reference(x, signs)


@_rotate_op.register_kernel("cuda")
def _rotate_cuda(x, signs):
    n = x.shape[-1]
    if not (_kernel_dtype(x) and _kernels_ok() and _hadamard_ok(n)):
        return rotate_reference(x, signs)
    k, p2 = decompose(n)
    x2 = x.reshape(-1, n).contiguous()
    dev = x.device
    hk = _hadamard_factor(k, dev) if k > 1 else None
    with torch.cuda.device(dev):
        y = kernel_build.extension(dev).hadamard(
            x2, signs.contiguous(), hk, k, p2, _stream(dev), _num_sms(dev), _pdl_on(dev), None
        )
    return y.reshape(x.shape)


@_rotate_op.register_fake
def _(x, signs):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _runtime_tensors(codes, codes_b, row_scale) -> dict[str, torch.Tensor]:
    """The ops' tensor arguments back as the layer's named tensors (the inverse of code_tensors)."""
    tensors = {"row_scale": row_scale}
    tensors.update({"codes_a": codes, "codes_b": codes_b} if codes_b is not None else {"codes": codes})
    return tensors


def _qmm_reference(x, codes, codes_b, row_scale, quantizer, out_features):
    return quantized_matmul_reference(x, quantizer, _runtime_tensors(codes, codes_b, row_scale),
                                      (out_features, x.shape[-1]))


@torch.library.custom_op("qpalette::quantized_matmul", mutates_args=())
def _qmm_op(
    x: torch.Tensor,
    codes: torch.Tensor,
    codes_b: Optional[torch.Tensor],
    row_scale: torch.Tensor,
    quantizer: str,
    out_features: int,
) -> torch.Tensor:
    return _qmm_reference(x, codes, codes_b, row_scale, quantizer, out_features)


@_qmm_op.register_kernel("cuda")
def _(x, codes, codes_b, row_scale, quantizer, out_features):
    if not (_kernel_dtype(x) and _kernels_ok()):
        return _qmm_reference(x, codes, codes_b, row_scale, quantizer, out_features)
    return _qmm_cuda(x, codes, codes_b, row_scale, quantizer, out_features)


def _qmm_cuda(x, codes, codes_b, row_scale, quantizer, out_features, signs=None, gated=False, norm=None,
              y_add=None):
    """The matmul ops on the kernels: all leading dimensions of x as activation rows (`norm`'s
    residual and h_out shaped like x, h_out contiguous; `y_add` like y)."""
    lead, n_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n_in).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*lead, out_features))
    if norm is not None:
        weight, eps, residual, h_out = norm
        norm = (weight.contiguous(), eps, residual.reshape(-1, n_in).contiguous() if residual is not None else None,
                h_out.view(-1, n_in) if h_out is not None else None)
    if (gated or norm is not None) and not fuses_rotation(n_in // 2 if gated else n_in, x2.shape[0]):
        formed = _formed_rotation(x2, signs.contiguous(), gated, norm)  # batch > 1: no elementwise kernel
        if formed is not None:
            x2, signs, gated, norm = formed, None, False, None
    y = _qmm_kernels(x2, codes.contiguous(), codes_b.contiguous() if codes_b is not None else None,
                     row_scale, quantizer, out_features, signs.contiguous() if signs is not None else None, gated,
                     norm, y_add.reshape(-1, out_features).contiguous() if y_add is not None else None)
    return y.reshape(*lead, out_features)


def _normed_input(x2, weight, eps, residual, h_out):
    h = x2 if residual is None else torch.add(x2, residual, out=h_out)
    return rms_norm_reference(h, weight, eps)


def _formed_rotation(x2, signs, gated, norm):
    """H(s ⊙ input) by the rotation kernel forming the input itself (silu(gate) ⊙ up, or add +
    RMSNorm with the sum written to norm's h_out), or None where that kernel does not take the size
    (the caller then forms the input in torch). Under programmatic dependent launch the kernel caps
    its blocks a SM (hadamard.cu spread_blocks): launched early after a GEMV they would crowd onto the
    first SMs that GEMV frees (results/kernels_h200/v21/ §3)."""
    n = x2.shape[1] // 2 if gated else x2.shape[1]
    if not _hadamard_ok(n):
        return None
    k, p2 = decompose(n)
    dev = x2.device
    weight, eps, residual, h_out = norm or (None, 0.0, None, None)
    with torch.cuda.device(dev):
        return kernel_build.extension(dev).hadamard_formed(
            x2, signs, _hadamard_factor(k, dev) if k > 1 else None, k, p2, _stream(dev), _num_sms(dev),
            _pdl_on(dev), gated, weight, eps, residual, h_out)


def _qmm_kernels(x2, codes, codes_b, row_scale, quantizer, out_features, signs=None, gated=False, norm=None,
                 y_add=None):
    """y = x2 · W_rᵀ on the kernels; with `signs`, x2 is rotated first (in the GEMV when it can);
    `gated`: x2 = [gate | up] and the input is silu(gate) ⊙ up; `norm` = (weight, eps, residual,
    h_out): the input is rms_norm_reference(x2 + residual) with the sum written to h_out (residual
    and h_out may be None); `y_add` (rows, out) is added to y. The GEMV does each of these itself
    when it can; otherwise torch does them around the plain path."""
    dev = x2.device
    spec = kernel_spec(quantizer)
    table = lut(quantizer, x2.dtype, dev)
    ext = kernel_build.extension(dev)
    family = ext.FAMILY_CODES[spec.family]
    k, hk = 1, None
    if signs is not None:
        k = decompose(x2.shape[1] // 2 if gated else x2.shape[1])[0]
        hk = _hadamard_row_masks(k, dev) if k > 1 and k <= FUSED_ROTATION_MAX_K else None
    with torch.cuda.device(dev):
        if x2.shape[0] <= FUSED_MAX_ROWS:
            nw, eps, res, h_out = norm or (None, 0.0, None, None)
            y = ext.gemv(x2, codes, codes_b, row_scale, table, family, spec.p0, spec.p1, out_features,
                         _stream(dev), _num_sms(dev), _pdl(), signs, hk, k, gated, nw, eps, res, h_out, y_add)
            if y is not None:
                return y
        if norm is not None or gated:
            x2 = _normed_input(x2, *norm) if norm is not None else silu_mul_reference(x2)
            return _qmm_kernels(x2, codes, codes_b, row_scale, quantizer, out_features, signs, y_add=y_add)
        if y_add is not None:
            return _qmm_kernels(x2, codes, codes_b, row_scale, quantizer, out_features, signs) + y_add
        if signs is not None:
            x2 = _rotate_cuda(x2, signs)
            return _qmm_kernels(x2, codes, codes_b, row_scale, quantizer, out_features)
        w = ext.dequant(codes, codes_b, row_scale, table, family, spec.p0, spec.p1,
                        out_features, x2.shape[1], x2.dtype, _stream(dev), _num_sms(dev))
        return x2 @ w.T


@_qmm_op.register_fake
def _(x, codes, codes_b, row_scale, quantizer, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("qpalette::rotated_matmul", mutates_args=())
def _rotated_qmm_op(
    x: torch.Tensor,
    signs: torch.Tensor,
    codes: torch.Tensor,
    codes_b: Optional[torch.Tensor],
    row_scale: torch.Tensor,
    quantizer: str,
    out_features: int,
) -> torch.Tensor:
    return _qmm_reference(rotate_reference(x, signs), codes, codes_b, row_scale, quantizer, out_features)


@_rotated_qmm_op.register_kernel("cuda")
def _(x, signs, codes, codes_b, row_scale, quantizer, out_features):
    if not (_kernel_dtype(x) and _kernels_ok()):
        return _qmm_reference(rotate_reference(x, signs), codes, codes_b, row_scale, quantizer, out_features)
    return _qmm_cuda(x, codes, codes_b, row_scale, quantizer, out_features, signs)


@_rotated_qmm_op.register_fake
def _(x, signs, codes, codes_b, row_scale, quantizer, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _gated_reference(gu, signs, codes, codes_b, row_scale, quantizer, out_features, residual):
    x = rotate_reference(silu_mul_reference(gu), signs)
    y = _qmm_reference(x, codes, codes_b, row_scale, quantizer, out_features)
    return y if residual is None else y + residual


# the schema repeats rotated_matmul's (torch.library infers it from the annotations)
@torch.library.custom_op("qpalette::gated_rotated_matmul", mutates_args=())
def _gated_qmm_op(
    gu: torch.Tensor,
    signs: torch.Tensor,
    codes: torch.Tensor,
    codes_b: Optional[torch.Tensor],
    row_scale: torch.Tensor,
    quantizer: str,
    out_features: int,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return _gated_reference(gu, signs, codes, codes_b, row_scale, quantizer, out_features, residual)


@_gated_qmm_op.register_kernel("cuda")
def _(gu, signs, codes, codes_b, row_scale, quantizer, out_features, residual=None):
    if not (_kernel_dtype(gu) and _kernels_ok()) or (residual is not None and residual.dtype != gu.dtype):
        return _gated_reference(gu, signs, codes, codes_b, row_scale, quantizer, out_features, residual)
    return _qmm_cuda(gu, codes, codes_b, row_scale, quantizer, out_features, signs, gated=True, y_add=residual)


@_gated_qmm_op.register_fake
def _(gu, signs, codes, codes_b, row_scale, quantizer, out_features, residual=None):
    return gu.new_empty((*gu.shape[:-1], out_features))


def _normed_reference(x, residual, norm_weight, eps, signs, codes, codes_b, row_scale, quantizer, out_features):
    h = x if residual is None else x + residual
    xr = rotate_reference(rms_norm_reference(h, norm_weight, eps), signs)
    return _qmm_reference(xr, codes, codes_b, row_scale, quantizer, out_features), _sum_or_empty(h, residual)


def _sum_or_empty(h, residual):
    """The op's second output: x + residual, or an empty tensor without a residual (an op's output
    may not alias its input)."""
    return h if residual is not None else h.new_empty(0)


@torch.library.custom_op("qpalette::normed_rotated_matmul", mutates_args=())
def _normed_qmm_op(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    signs: torch.Tensor,
    codes: torch.Tensor,
    codes_b: Optional[torch.Tensor],
    row_scale: torch.Tensor,
    quantizer: str,
    out_features: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _normed_reference(x, residual, norm_weight, eps, signs, codes, codes_b, row_scale, quantizer, out_features)


@_normed_qmm_op.register_kernel("cuda")
def _(x, residual, norm_weight, eps, signs, codes, codes_b, row_scale, quantizer, out_features):
    same = norm_weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    if not (_kernel_dtype(x) and _kernels_ok() and same) or x.numel() == 0:
        return _normed_reference(x, residual, norm_weight, eps, signs, codes, codes_b, row_scale, quantizer,
                                 out_features)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    y = _qmm_cuda(x, codes, codes_b, row_scale, quantizer, out_features, signs, norm=(norm_weight, eps, residual, h))
    return y, _sum_or_empty(h if h is not None else x, residual)


@_normed_qmm_op.register_fake
def _(x, residual, norm_weight, eps, signs, codes, codes_b, row_scale, quantizer, out_features):
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x.new_empty(0)
    return x.new_empty((*x.shape[:-1], out_features)), h


# MoE experts (runtime/experts.py): the kernel reads each slot's member and that member's tensors
# through `table` (device addresses, (members, 4) int64); codes … signs are member 0's, for shapes.
# CUDA only: other devices run expert_matmul_reference on the tensors themselves.
@torch.library.custom_op("qpalette::expert_matmul", mutates_args=(), device_types="cuda")
def expert_matmul(x: torch.Tensor, x_rows: torch.Tensor, members: torch.Tensor, table: torch.Tensor,
                  codes: torch.Tensor, codes_b: Optional[torch.Tensor], row_scale: torch.Tensor,
                  signs: torch.Tensor, quantizer: str, out_features: int) -> torch.Tensor:
    dev = x.device
    spec = kernel_spec(quantizer)
    k = decompose(x.shape[1])[0]
    hk = _hadamard_row_masks(k, dev) if k > 1 else None
    ext = kernel_build.extension(dev)
    with torch.cuda.device(dev):
        y = ext.gemv_experts(x, x_rows, members, table, codes, codes_b, row_scale, lut(quantizer, x.dtype, dev),
                             ext.FAMILY_CODES[spec.family], spec.p0, spec.p1, out_features, _stream(dev),
                             _num_sms(dev), _pdl(), signs, hk, k)
    if y is None:
        raise UnsupportedShape(f"the expert GEMV cannot split {out_features}x{x.shape[1]} ({quantizer})")
    return y


@expert_matmul.register_fake
def _(x, x_rows, members, table, codes, codes_b, row_scale, signs, quantizer, out_features):
    return x.new_empty((members.shape[0], out_features))


# ---- backward: gradients to the activations (the quantized weights are frozen) --------------------
# What LoRA adapters on a compressed model need: dL/dx of every quantized layer. For y = W_r·H(s⊙x):
# dL/dx = s ⊙ Hᵀ(dL/dy · W_r), with W_r decoded densely for the one layer (the dequantize kernel on
# CUDA, the reference elsewhere); codes, row scales and signs get no gradient. Both steps are custom
# ops themselves, so that a compiled backward sees them as opaque calls.

@torch.library.custom_op("qpalette::rotate_transposed", mutates_args=())
def rotate_transposed(g: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """s ⊙ Hᵀ g: the adjoint of `rotate` (the inverse transform of a weight row), in g's dtype."""
    return unrotate_weight(g, unpack_signs(signs)).to(g.dtype)


@rotate_transposed.register_fake
def _(g, signs):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def _dense_weight_reference(codes, codes_b, row_scale, quantizer, out_features, in_features, dtype):
    shape = (out_features, in_features)
    tensors = lanes.unpack(quantizer, _runtime_tensors(codes, codes_b, row_scale), shape)
    return dequantize(quantizer, tensors, shape).to(dtype)


@torch.library.custom_op("qpalette::dense_weight", mutates_args=())
def dense_weight(codes: torch.Tensor, codes_b: Optional[torch.Tensor], row_scale: torch.Tensor, quantizer: str,
                 out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """W_r (out × in) in `dtype` from the runtime (lane-major) tensors."""
    return _dense_weight_reference(codes, codes_b, row_scale, quantizer, out_features, in_features, dtype)


@dense_weight.register_kernel("cuda")
def _(codes, codes_b, row_scale, quantizer, out_features, in_features, dtype):
    if dtype not in KERNEL_DTYPES or not _kernels_ok():
        return _dense_weight_reference(codes, codes_b, row_scale, quantizer, out_features, in_features, dtype)
    spec, dev = kernel_spec(quantizer), codes.device
    ext = kernel_build.extension(dev)
    with torch.cuda.device(dev):
        return ext.dequant(codes.contiguous(), codes_b.contiguous() if codes_b is not None else None, row_scale,
                           lut(quantizer, dtype, dev), ext.FAMILY_CODES[spec.family], spec.p0, spec.p1,
                           out_features, in_features, dtype, _stream(dev), _num_sms(dev))


@dense_weight.register_fake
def _(codes, codes_b, row_scale, quantizer, out_features, in_features, dtype):
    return row_scale.new_empty((out_features, in_features), dtype=dtype)


def _matmul_input_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    codes, codes_b, row_scale = ctx.saved_tensors[-3:]
    w = dense_weight(codes, codes_b, row_scale, ctx.quantizer, ctx.out_features, ctx.in_features, grad.dtype)
    return grad @ w


def _save_matmul(ctx, x, codes, codes_b, row_scale, quantizer, out_features, signs=None) -> None:
    ctx.quantizer, ctx.out_features, ctx.in_features = quantizer, out_features, x.shape[-1]
    ctx.save_for_backward(*([signs] if signs is not None else []), codes, codes_b, row_scale)


def _rotate_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


def _rotate_backward(ctx, grad):
    return rotate_transposed(grad, ctx.saved_tensors[0]), None


def _qmm_setup(ctx, inputs, output) -> None:
    _save_matmul(ctx, *inputs)


def _qmm_backward(ctx, grad):
    return _matmul_input_grad(ctx, grad), None, None, None, None, None


def _rotated_qmm_setup(ctx, inputs, output) -> None:
    x, signs, *rest = inputs
    _save_matmul(ctx, x, *rest, signs=signs)


def _rotated_qmm_backward(ctx, grad):
    dx = rotate_transposed(_matmul_input_grad(ctx, grad), ctx.saved_tensors[0])
    return dx, None, None, None, None, None, None


_rotate_op.register_autograd(_rotate_backward, setup_context=_rotate_setup)
_qmm_op.register_autograd(_qmm_backward, setup_context=_qmm_setup)
_rotated_qmm_op.register_autograd(_rotated_qmm_backward, setup_context=_rotated_qmm_setup)
