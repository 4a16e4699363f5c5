"""Build every codebook of the palette (seeded, deterministic) into profiles/codebooks.safetensors.

NUQ: 1-D Lloyd–Max run to convergence on 4·10^7 N(0,1) samples. VQ: 2-D k-means on
max(2^22, 1024·K) N(0, I₂) samples. TCQ: 2-D k-means of 2^20 N(0, I₂) samples into 2^Q
centroids from K random samples, rescaled to an entry standard deviation of √(15/16)
(docs/method.md §2). Each VQ k-means runs three times, from K random samples, from the jittered product
grid of two 1-D Lloyd–Max codebooks (2^⌊c/2⌋ × 2^⌈c/2⌉ levels; unjittered it is a fixed point
of k-means) and from a hexagonal lattice companded radially to the high-rate optimal point
density ∝ p^(1/2) (a N(0, 2I) profile), and keeps the run with the lower training MSE:
random starts win for small K, the lattice for large K. TCQ tables start from random samples only: a grid-started table has a
lower k-means MSE but makes TCQ 2–30% worse (measured: tcq-3.0 0.0199 vs 0.0189).
Each codebook draws its samples from its own generator, seeded by (seed, name).
About a minute on a GPU (`--device cuda`); the large 2-D codebooks take an hour on 2 CPU
cores. The shipped file was built with `--device cuda`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qpalette.quant.codebooks import TCQ_LUT_STD, kmeans, lloyd_max_1d, nearest, product_grid

NUQ_BITS = range(2, 9)
VQ_CODE_BITS = range(3, 13)  # 1.5 ... 6.0 bits per weight
TCQ_Q = (9, 10, 11)


def generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def companded_hex_lattice(k: int) -> torch.Tensor:
    """The k hexagonal-lattice points nearest the origin, mapped radially so that their density
    follows N(0, 2I): a uniform disc of radius R has mass (ρ/R)² inside ρ, N(0, 2I) has
    1 − exp(−r²/4) inside r."""
    n = int(math.sqrt(k)) + 4
    i, j = torch.meshgrid(torch.arange(-n, n + 1.0), torch.arange(-n, n + 1.0), indexing="ij")
    pts = torch.stack((i + 0.5 * j, j * math.sqrt(3) / 2), -1).reshape(-1, 2).double()
    pts = pts + torch.tensor([0.31, 0.17], dtype=torch.float64)  # no point at the origin, no ties
    pts = pts[torch.argsort(pts.norm(dim=-1))[:k]]
    rho = pts.norm(dim=-1)
    radius = rho.max() * (1 + 0.5 / math.sqrt(k))
    r = torch.sqrt(-4 * torch.log1p(-((rho / radius) ** 2)))
    return (pts * (r / rho).unsqueeze(-1)).float()


def kmeans_2d(
    pts: torch.Tensor, code_bits: int, iters: int, g: torch.Generator, grid_start: bool = True
) -> torch.Tensor:
    """Best of a random-sample start and (optionally) a jittered product-grid start."""
    k = 2**code_bits
    scalar = torch.randn(4_000_000, generator=g)
    lo, hi = code_bits // 2, code_bits - code_bits // 2
    grid = product_grid(lloyd_max_1d(scalar, 2**lo), lloyd_max_1d(scalar, 2**hi))
    spacing = 2.0 / 2 ** (code_bits / 2)
    starts = [pts[torch.randperm(pts.shape[0], generator=g)[:k].to(pts.device)].cpu()]
    if grid_start:
        starts.append(grid + 0.25 * spacing * torch.randn(grid.shape, generator=g))
        starts.append(companded_hex_lattice(k))
    best, best_mse = None, float("inf")
    for start in starts:
        c = kmeans(pts, start, iters)
        mse = float((pts - c[nearest(pts, c)]).pow(2).sum(-1).mean())
        if mse < best_mse:
            best, best_mse = c, mse
    return best.cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "profiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=300, help="2-D k-means iterations")
    ap.add_argument("--device", default="cpu", help="where the 2-D k-means runs (cpu, cuda)")
    ap.add_argument("--only", nargs="*", help="build only these names (e.g. nuq.2 tcq.q9)")
    args = ap.parse_args()
    names = [f"nuq.{b}" for b in NUQ_BITS] + [f"vq.{c}" for c in VQ_CODE_BITS]
    names += [f"tcq.q{q}" for q in TCQ_Q]
    target = args.out / "codebooks.safetensors"
    # --only updates the named codebooks of an existing file and keeps the rest
    books: dict[str, torch.Tensor] = load_file(str(target)) if args.only and target.exists() else {}
    t0 = time.time()
    for name in names:
        if args.only and name not in args.only:
            continue
        g = generator(args.seed, name)
        family, size = name.split(".")
        if family == "nuq":
            books[name] = lloyd_max_1d(torch.randn(40_000_000, generator=g), 2 ** int(size))
        elif family == "vq":
            c = int(size)
            pts = torch.randn(max(2**22, 1024 * 2**c), 2, generator=g).to(args.device)
            books[name] = kmeans_2d(pts, c, args.iters, g)
        else:
            q = int(size[1:])
            pts = torch.randn(2**20, 2, generator=g).to(args.device)
            t = kmeans_2d(pts, q, args.iters, g, grid_start=False)
            books[name] = t * (TCQ_LUT_STD / t.std())
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)
    meta = {"seed": str(args.seed), "iters": str(args.iters), "device": args.device,
            "built_by": "scripts/build_codebooks.py"}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "codebooks.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in books.items()}, str(tmp), metadata=meta)
    tmp.replace(target)
    print(json.dumps({k: list(v.shape) for k, v in books.items()}))


if __name__ == "__main__":
    main()
