"""Run a sample of the CUDA kernels under NVIDIA compute-sanitizer (memcheck, racecheck, synccheck).

    python scripts/sanitize_kernels.py [--tools memcheck,racecheck,synccheck] [--out DIR]
        [--parts gemv,hadamard,attention,viterbi]

Each tool runs this script again (`--sample`) as `compute-sanitizer --tool T --error-exitcode 9`,
with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own
cudaMalloc, so a read past a tensor's end leaves its allocation and memcheck sees it). The sample:
one palette entry of every decoder variant (TCQ with a one- and a two-lane halo, half-TCQ, NUQ,
VQ), both 16-bit dtypes, batch 1 and 8 on the GEMV (a padded last lane group, a shape with more
warps than groups, clusters of 8 CTAs) and batch 9 on the dequantize kernel, the rotation fused
into the GEMV (inputs 4096, 1536 = 12·128 and 14336 = 28·512 over a cluster; batch 1 and 8), and
the Hadamard kernel, the decode attention (one split, several merged by a second kernel or inside
a cluster, bool, additive and shared masks, batch 1–3, head dim 64 and 128, fp16 and bf16) and the
encoder's Viterbi (KV 2, 8, 10);
every result is also checked against the PyTorch reference.
Logs go to DIR/sanitize_<tool>.log; the exit code is 0 only when no tool reports anything in
qpalette's kernels (reports in other libraries' kernels, e.g. racecheck on cuBLAS, are counted
and shown, not failed on) and every sample result matches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ENTRIES = ("tcq-2.0", "tcq-4.0", "half-tcq-3.25", "nuq-4", "vq-2.0", "vq-4.0")
SHAPES = ((576, 1536), (32, 64), (256, 28672))
TOOLS = ("memcheck", "racecheck", "synccheck")
PARTS = ("gemv", "hadamard", "attention", "viterbi")  # --parts: racecheck over all of them takes many minutes


def sample(parts=PARTS) -> int:
    """The kernels' sample (its `parts`), checked against the reference; returns the number of
    mismatches."""
    import torch

    from qpalette.quant.incoherence import pack_signs, random_signs, rotate_input
    from qpalette.runtime import kernel_build, ops

    kernel_build.extension()
    gen = torch.Generator().manual_seed(0)
    bad = 0
    if "gemv" in parts:
        bad += _gemv_sample(gen)
    if "hadamard" in parts:
        x = torch.randn(8, 14336, generator=gen).half().cuda()
        signs = random_signs(14336, 2)
        y = ops.rotate(x, pack_signs(signs).cuda())
        bad += _report("hadamard 14336", y, rotate_input(x.float(), signs.cuda()))
    if "attention" in parts:
        bad += _attention_sample(gen)
    if "viterbi" in parts:
        bad += _viterbi_sample(gen)
    torch.cuda.synchronize()
    print(f"sample done: {bad} mismatches")
    return bad


def _gemv_sample(gen) -> int:
    """The GEMV (every decoder variant, both dtypes, batch 1 and 8), the dequantize kernel (batch 9)
    and the rotation fused into the GEMV."""
    import torch

    from qpalette.quant.palette import get_quantizer
    from qpalette.runtime import lanes, ops

    bad = 0
    for name in ENTRIES:
        for rows, cols in SHAPES:
            stored = {k: v.cuda() for k, v in get_quantizer(name).random_tensors(rows, cols, gen).items()}
            tensors = lanes.pack(name, stored)
            w = ops.dequantize(name, stored, (rows, cols))
            for dtype in (torch.float16, torch.bfloat16):
                for m in (1, 8, 9):
                    x = torch.randn(m, cols, generator=gen).to(dtype).cuda()
                    y = ops.quantized_matmul(x, name, tensors, (rows, cols))
                    bad += _report(f"{name} {rows}x{cols} {dtype} m={m}", y, x.float() @ w.T)
        for cols in (4096, 1536, 14336):  # the rotation inside the GEMV: 2^m, 12·128, 28·512 (a cluster)
            bad += _rotated_sample(name, 576, cols, gen)
    return bad


def _rotated_sample(name: str, rows: int, cols: int, gen) -> int:
    """rotated_matmul at batch 1 and 8 against rotate-then-multiply in the reference."""
    import torch

    from qpalette.quant.incoherence import pack_signs, random_signs, rotate_input
    from qpalette.quant.palette import get_quantizer
    from qpalette.runtime import lanes, ops

    stored = {k: v.cuda() for k, v in get_quantizer(name).random_tensors(rows, cols, gen).items()}
    signs = random_signs(cols, 1)
    w = ops.dequantize(name, stored, (rows, cols))
    bad = 0
    for m in (1, 8):
        x = torch.randn(m, cols, generator=gen).half().cuda()
        y = ops.rotated_matmul(x, pack_signs(signs).cuda(), name, lanes.pack(name, stored), (rows, cols))
        bad += _report(f"{name} {rows}x{cols} rotated m={m}", y, rotate_input(x.float(), signs.cuda()) @ w.T)
    return bad


def _attention_sample(gen) -> int:
    """qpalette::decode_attention (kernel) against its reference: one split (80 keys), several
    (4097 keys: splits and their merge kernel; 300 and 700 keys at batch 3 and 2: 3 and 6 splits,
    merged inside a cluster on a 132-SM Hopper), bool / additive / one shared mask row, batch 1–3,
    head dims 64/128, 1/4/8 query heads a KV head, fp16 and bf16."""
    import torch

    from qpalette.runtime import decode_attention as da

    bad = 0
    cases = ((1, 80, 128, "bool", 4, torch.float16), (3, 4097, 128, "add", 4, torch.float16),
             (3, 300, 64, "bool", 8, torch.bfloat16), (1, 4097, 64, None, 4, torch.float16),
             (2, 700, 128, "shared", 1, torch.bfloat16))
    for b, length, d, kind, groups, dtype in cases:
        q = torch.randn(b, 8 * groups, d, generator=gen).to(dtype).cuda()
        k, v = (torch.randn(b, 8, length, d, generator=gen).to(dtype).cuda() for _ in range(2))
        mask = None
        if kind:  # (B, L), or one row for every batch row ("shared")
            keep = (torch.rand(1 if kind == "shared" else b, length, generator=gen) > 0.2).cuda()
            mask = torch.where(keep, 0.0, -1e4).to(dtype) if kind == "add" else keep
        if not da.kernel_applies(q, k, v, mask):
            print(f"MISMATCH attention b={b} L={length} d={d}: the kernel does not take it")
            bad += 1
            continue
        y = da.decode_attention(q, k, v, mask, d ** -0.5)
        ref = da.reference(q, k, v, mask, d ** -0.5)
        bad += _report(f"attention b={b} L={length} d={d} G={groups} {dtype} mask={kind}", y, ref)
    return bad


def _viterbi_sample(gen) -> int:
    """The encoder's Viterbi (KV 2: minima a thread; 8 and 10: minima shared by threads) on a few
    tiles, its path costs against the torch reference's."""
    import torch

    from qpalette.quant.codebooks import codebook
    from qpalette.quant.trellis import _tail_biting_paths, kernel_paths, lut_bits, state_values

    bad = 0
    for kv in (2, 8, 10):
        x = torch.randn(5, 128, 2, generator=gen).cuda()
        table = codebook(f"tcq.q{lut_bits(kv)}").cuda()
        values = state_values(table)
        cost = [(values[p] - x).pow(2).sum() for p in (kernel_paths(x, table, kv), _tail_biting_paths(x, values, kv))]
        bad += _report(f"viterbi kv={kv}", cost[0].reshape(1), cost[1].reshape(1))
    return bad


def _report(what: str, y, ref) -> int:
    err = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    if not err <= 1e-2:
        print(f"MISMATCH {what}: relative error {err:.3g}")
        return 1
    return 0


def sanitizer() -> str:
    """Path of compute-sanitizer: on PATH, or in CUDA_HOME's bin folder."""
    found = shutil.which("compute-sanitizer")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "compute-sanitizer"
    if found:
        return found
    if candidate.is_file():
        return str(candidate)
    sys.exit("compute-sanitizer not found: put the CUDA toolkit's bin folder on PATH or set CUDA_HOME")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma list of compute-sanitizer tools")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the logs")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma list of the sample's parts to run (default all: {','.join(PARTS)})")
    ap.add_argument("--sample", action="store_true", help="run the sample itself (what each tool runs)")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        ap.error(f"--parts {args.parts}: choose from {','.join(PARTS)}")
    if args.sample:
        return 1 if sample(parts) else 0
    exe = sanitizer()
    args.out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    failed = []
    for tool in args.tools.split(","):
        cmd = [exe, "--tool", tool, "--error-exitcode", "9", sys.executable, __file__, "--sample", "--parts",
               ",".join(parts)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = args.out / f"sanitize_{tool}.log"
        log.write_text(" ".join(cmd) + "\n\n" + res.stdout + res.stderr)
        ours, others = classify(res.stdout + res.stderr)
        done = "sample done: 0 mismatches" in res.stdout
        print(f"{tool}: {ours} reports in qpalette's kernels, {others} in other libraries' kernels "
              f"(cuBLAS, PyTorch), sample {'ran clean' if done else 'FAILED'} ({log})")
        if ours or not done:
            failed.append(tool)
    return 1 if failed else 0


OUR_KERNELS = ("gemv_kernel", "dequant_kernel", "hadamard_kernel", "decode_attention")


def classify(output: str) -> tuple[int, int]:
    """(reports naming one of our kernels, reports naming only other kernels). A report starts at
    a `========= X` line (X not a space; the banner and summaries excepted) and goes on over the
    indented lines after it; cuBLAS' own kernels are not ours to fix."""
    reports, current = [], None
    for line in output.splitlines():
        head = line[10:11]
        if (line.startswith("========= ") and head.strip()
                and "COMPUTE-SANITIZER" not in line and "SUMMARY" not in line):
            current = [line]
            reports.append(current)
        elif current is not None and line.startswith("=========     "):
            current.append(line)
        else:
            current = None
    ours = sum(any(k in ln for ln in r for k in OUR_KERNELS) for r in reports)
    return ours, len(reports) - ours


if __name__ == "__main__":
    sys.exit(main())
