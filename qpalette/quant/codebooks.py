"""The palette's codebooks: built once by scripts/build_codebooks.py, shipped in profiles/.

Run-time code only loads them; a missing or damaged file is an error, never a silent rebuild.
Names: `nuq.<bits>` (2^b,) sorted scalar levels, `vq.<code bits>` (2^c, 2) centroids,
`tcq.q<Q>` (2^Q, 2) the TCQ hybrid-code table T.
"""

from __future__ import annotations

import functools
import math
import os
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from qpalette.errors import CodebookError

CODEBOOK_FILE = "codebooks.safetensors"
TCQ_LUT_STD = math.sqrt(15 / 16)


def profiles_dir() -> Path:
    """The shipped profiles/ folder; QPALETTE_PROFILES points elsewhere (tests, experiments)."""
    override = os.environ.get("QPALETTE_PROFILES")
    if override:
        return Path(override)
    source_tree = Path(__file__).resolve().parents[2] / "profiles"  # running from a checkout
    if (source_tree / CODEBOOK_FILE).is_file():
        return source_tree
    return Path(str(resources.files("qpalette._profiles")))


@functools.lru_cache(maxsize=None)
def _all_codebooks(path: str) -> dict[str, torch.Tensor]:
    try:
        # fp16-representable values: checkpoints store codebooks in fp16 and kernels decode in
        # fp16, so encoding against exactly these keeps encoder, reference and kernels equal.
        return {k: v.half().float() for k, v in load_file(path).items()}
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise CodebookError(
            f"cannot read the shipped codebooks at {path} ({e}); reinstall qpalette or run "
            "scripts/build_codebooks.py"
        ) from e


def codebook(name: str) -> torch.Tensor:
    """A shipped codebook as float32 holding fp16-exact values (CPU); raises CodebookError naming what is missing."""
    books = _all_codebooks(str(profiles_dir() / CODEBOOK_FILE))
    if name not in books:
        raise CodebookError(f"codebook {name!r} is not in {CODEBOOK_FILE} (have: {sorted(books)})")
    return books[name]


def lloyd_max_1d(samples: torch.Tensor, levels: int, iters: int = 100_000) -> torch.Tensor:
    """1-D k-means (Lloyd–Max) on samples from quantile initialisation, run to convergence.

    Each iteration is O(levels · log n) on sorted samples with prefix sums, so running the slow
    tail levels to a 1e-12 fixed point costs seconds even for 256 levels.
    """
    x, _ = torch.sort(samples.double().cpu())
    n = x.numel()
    prefix = torch.cat([torch.zeros(1, dtype=x.dtype), torch.cumsum(x, 0)])
    c = x[((torch.arange(levels, dtype=torch.float64) + 0.5) / levels * n).long()]
    for _ in range(iters):
        edges = torch.searchsorted(x, (c[1:] + c[:-1]) / 2)
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), edges, torch.tensor([n])])
        new = (prefix[bounds[1:]] - prefix[bounds[:-1]]) / (bounds[1:] - bounds[:-1]).clamp(min=1)
        converged = (new - c).abs().max() < 1e-12
        c = new
        if converged:
            break
    return c.float()


def nearest(points: torch.Tensor, centroids: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) for each row of `points`."""
    c2 = (centroids * centroids).sum(-1)
    out = torch.empty(points.shape[0], dtype=torch.long, device=points.device)
    for i in range(0, points.shape[0], chunk):
        p = points[i : i + chunk]
        out[i : i + chunk] = torch.addmm(c2, p, centroids.T, alpha=-2).argmin(-1)
    return out


def kmeans(samples: torch.Tensor, init: torch.Tensor, iters: int) -> torch.Tensor:
    """Lloyd's k-means in any dimension from given initial centroids (deterministic).

    An empty cluster keeps its centroid (the starts used by scripts/build_codebooks.py are
    sample points or lattice points inside the data, so clusters start populated).
    """
    c = init.to(samples.device, samples.dtype).clone()
    k = c.shape[0]
    for _ in range(iters):
        idx = nearest(samples, c)
        sums = torch.zeros_like(c).index_add_(0, idx, samples)
        counts = torch.bincount(idx, minlength=k).unsqueeze(-1)
        c = torch.where(counts > 0, sums / counts.clamp(min=1), c)
    return c


def product_grid(levels_x: torch.Tensor, levels_y: torch.Tensor) -> torch.Tensor:
    """All (x, y) pairs of two 1-D codebooks: the initialisation of 2-D k-means."""
    gx, gy = torch.meshgrid(levels_x, levels_y, indexing="ij")
    return torch.stack((gx.reshape(-1), gy.reshape(-1)), dim=-1)
