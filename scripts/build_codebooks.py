"""Build every codebook of the palette (seeded, deterministic) into profiles/codebooks.safetensors.

NUQ: 1-D Lloyd–Max on 10^7 N(0,1) samples. VQ: 2-D k-means on max(2^20, 256·K) N(0, I₂)
samples. TCQ: 2-D k-means of 2^20 N(0, I₂) samples into 2^Q centroids, rescaled to an entry
standard deviation of √(15/16) (SPEC §2). About a minute on a GPU (`--device cuda`); the
large 2-D codebooks take tens of minutes on 2 CPU cores. The shipped file was built on CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from qpalette.codebooks import TCQ_LUT_STD, kmeans, lloyd_max_1d

NUQ_BITS = range(2, 9)
VQ_CODE_BITS = range(3, 13)  # 1.5 ... 6.0 bits per weight
TCQ_Q = (9, 10, 11)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "profiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=80, help="2-D k-means iterations")
    ap.add_argument("--device", default="cpu", help="where the k-means runs (cpu, cuda)")
    ap.add_argument("--only", nargs="*", help="build only these names (e.g. nuq.2 tcq.q9)")
    args = ap.parse_args()
    want = (lambda name: name in args.only) if args.only else (lambda name: True)
    torch.manual_seed(args.seed)
    books: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    scalar = torch.randn(10_000_000, generator=g)
    for b in NUQ_BITS:
        if not want(f"nuq.{b}"):
            continue
        books[f"nuq.{b}"] = lloyd_max_1d(scalar, 2**b)
        print(f"nuq.{b} done ({time.time() - t0:.0f} s)", flush=True)
    for c in VQ_CODE_BITS:
        k = 2**c
        pts = torch.randn(max(2**20, 256 * k), 2, generator=g)
        if not want(f"vq.{c}"):
            continue
        books[f"vq.{c}"] = kmeans(pts.to(args.device), k, args.iters, g).cpu()
        print(f"vq.{c} done ({time.time() - t0:.0f} s)", flush=True)
    for q in TCQ_Q:
        pts = torch.randn(2**20, 2, generator=g)
        if not want(f"tcq.q{q}"):
            continue
        t = kmeans(pts.to(args.device), 2**q, args.iters, g).cpu()
        books[f"tcq.q{q}"] = t * (TCQ_LUT_STD / t.std())
        print(f"tcq.q{q} done ({time.time() - t0:.0f} s)", flush=True)
    meta = {"seed": str(args.seed), "iters": str(args.iters), "built_by": "scripts/build_codebooks.py"}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "codebooks.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in books.items()}, str(tmp), metadata=meta)
    tmp.replace(args.out / "codebooks.safetensors")
    print(json.dumps({k: list(v.shape) for k, v in books.items()}))


if __name__ == "__main__":
    main()
