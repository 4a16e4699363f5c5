"""Block LDLQ (docs/method.md §7): rounding that lowers the proxy loss tr((W − Ŵ) H (W − Ŵ)ᵀ).

H (cols × cols) is the second moment of the layer's inputs, in the basis of the rotated weight
(`incoherence.rotate_hessian`). It is damped, H + λI with λ = damp · mean(diag H), and factored as
H = A D Aᵀ, A unit upper block-triangular in blocks of g = `Quantizer.block_cols` columns, D block
diagonal. With E = W − Ŵ, tr(E H Eᵀ) = Σ_k tr(R_k D_k R_kᵀ) where R = E A, so coding column
block k as the nearest code of

    T_k = W_k + Σ_{j<k} E_j A_jk

leaves R_k = T_k − Ŵ_k a plain rounding error, weighed by D_k instead of H_kk (D_k ⪯ H_kk): the
errors of the blocks already coded are fed into the later ones. Blocks go left to right, all rows
at once; the feedback of a chunk of columns into the columns after it is one matmul (GPTQ's lazy
batch update). Row scales come from the unadjusted W as in the data-free path, so the stored
format is unchanged; with H = I, A = I and the codes are the data-free ones.
"""

from __future__ import annotations

import torch

from qpalette.errors import InputError
from qpalette.quant.palette.base import QuantizedMatrix, Quantizer

DEFAULT_DAMP = 0.01  # λ = 1% of the mean diagonal, as GPTQ and QuIP# damp
CHUNK_COLS = 128  # columns between two lazy feedback updates: a multiple of every block size


def block_ldl(h: torch.Tensor, block: int) -> torch.Tensor:
    """A (float64) of H = A D Aᵀ: unit upper block-triangular with `block`-wide blocks.

    The Cholesky factor of the reversed matrix, P H P = C Cᵀ, gives P H P = L D' Lᵀ with
    L = C · blockdiag(C_kk)⁻¹ (unit lower block-triangular) and D'_k = C_kk C_kkᵀ; reversing back,
    A = P L P. Raises InputError when H is not positive definite."""
    n = h.shape[0]
    if n % block:
        raise ValueError(f"{n} columns are not whole blocks of {block}")
    flip = torch.arange(n - 1, -1, -1, device=h.device)
    c, info = torch.linalg.cholesky_ex(h.double()[flip][:, flip])
    if int(info):
        raise InputError("the Hessian is not positive definite even after damping; raise the damping "
                         "(--damp)")
    nb = n // block
    diag = c.view(nb, block, nb, block).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # C_kk, (nb, g, g)
    eye = torch.eye(block, dtype=c.dtype, device=c.device).expand(nb, block, block)
    inv = torch.linalg.solve_triangular(diag, eye, upper=False)
    lower = torch.einsum("rkg,kgh->rkh", c.view(n, nb, block), inv).reshape(n, n)
    lower.view(nb, block, nb, block).diagonal(dim1=0, dim2=2).copy_(eye.permute(1, 2, 0))  # exactly I
    return lower[flip][:, flip]


def ldl_feedback(h: torch.Tensor, block: int, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """The feedback matrix A (float32) of a Hessian for LDLQ with `block`-wide column blocks.

    A Hessian without any signal (zero trace) gives A = I: nothing to weigh, data-free rounding."""
    if damp < 0:
        raise InputError(f"damping {damp} is negative")
    h = h.double()
    scale = h.diagonal().mean()
    if not bool(scale > 0):
        return torch.eye(h.shape[0], device=h.device)
    h = h + damp * scale * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return block_ldl(h, block).float()


def ldlq(q: Quantizer, w: torch.Tensor, feedback: torch.Tensor) -> QuantizedMatrix:
    """Quantize w (rows × cols, rotated basis) with `q`, feeding the errors forward through
    `feedback` (from `ldl_feedback` with q.block_cols); the same stored tensors as `q.quantize`."""
    return ldlq_many(q, [w], [feedback])[0]


def ldlq_many(q: Quantizer, ws: list[torch.Tensor], feedbacks: list[torch.Tensor]) -> list[QuantizedMatrix]:
    """`ldlq` of several matrices with the same column count, in lockstep: each column block of all
    of them is coded by one `code_columns` call on their rows stacked. Rows are coded
    independently, so every result is its own `ldlq`'s; what changes is that a trellis entry runs
    one Viterbi batch per column block for all the matrices, not one per matrix (on a GPU the
    per-call cost, not the work, dominates LDLQ of small matrices)."""
    cols = {w.shape[1] for w in ws}
    if len(cols) != 1 or len(ws) != len(feedbacks):
        raise ValueError(f"ldlq_many needs one feedback per matrix and one column count, got {sorted(cols)}")
    normalised = [q.normalise(w) for w in ws]
    x = torch.cat([xi for xi, _ in normalised])
    n, g = x.shape[1], q.block_cols
    ends = torch.tensor([w.shape[0] for w in ws]).cumsum(0).tolist()
    spans = list(zip([0] + ends[:-1], ends))
    a = [f.to(x.device, torch.float32) for f in feedbacks]
    target = x.clone()
    err = torch.empty_like(x)  # X − X̂ of the columns coded so far

    def feed(c0: int, c1: int, k0: int, k1: int) -> None:
        """Every matrix's errors of columns c0:c1 into its targets of columns k0:k1."""
        for (r0, r1), ai in zip(spans, a):
            target[r0:r1, k0:k1] += err[r0:r1, c0:c1] @ ai[c0:c1, k0:k1]

    codes = []
    for c0 in range(0, n, CHUNK_COLS):
        c1 = min(n, c0 + CHUNK_COLS)
        for k0 in range(c0, c1, g):
            k1 = k0 + g
            if k0 > c0:  # feedback from this chunk's earlier blocks
                feed(c0, k0, k0, k1)
            code, recon = q.code_columns(target[:, k0:k1], k0, n)
            codes.append(code)
            err[:, k0:k1] = x[:, k0:k1] - recon
        if c1 < n:  # this chunk's feedback into every later column at once
            feed(c0, c1, c1, n)
    all_codes = torch.cat(codes, dim=1)
    per_row = all_codes.shape[0] / x.shape[0]  # raw codes hold rows (or 16-row tiles) along dim 0
    out = []
    for (r0, r1), w, (_, row_scale) in zip(spans, ws, normalised):
        tensors = q.pack(all_codes[round(r0 * per_row):round(r1 * per_row)], tuple(w.shape))
        tensors["row_scale"] = row_scale
        out.append(QuantizedMatrix(q.name, tuple(w.shape), tensors))
    return out


def proxy_loss(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W − Ŵ) H (W − Ŵ)ᵀ): the layer's output error ‖(W − Ŵ) x‖², averaged over inputs."""
    e = (w - w_hat).double()
    return float(((e @ h.double()) * e).sum())
