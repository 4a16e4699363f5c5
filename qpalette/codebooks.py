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

CODEBOOK_FILE = "codebooks.safetensors"
TCQ_LUT_STD = math.sqrt(15 / 16)


class CodebookError(RuntimeError):
    pass


def profiles_dir() -> Path:
    """The shipped profiles/ folder; QPALETTE_PROFILES points elsewhere (tests, experiments)."""
    override = os.environ.get("QPALETTE_PROFILES")
    return Path(override) if override else Path(str(resources.files("qpalette._profiles")))


@functools.lru_cache(maxsize=None)
def _all_codebooks(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise CodebookError(
            f"cannot read the shipped codebooks at {path} ({e}); reinstall qpalette or run "
            "scripts/build_codebooks.py"
        ) from e


def codebook(name: str) -> torch.Tensor:
    """A shipped codebook as float32 (CPU); raises CodebookError naming what is missing."""
    books = _all_codebooks(str(profiles_dir() / CODEBOOK_FILE))
    if name not in books:
        raise CodebookError(f"codebook {name!r} is not in {CODEBOOK_FILE} (have: {sorted(books)})")
    return books[name]


def lloyd_max_1d(samples: torch.Tensor, levels: int, iters: int = 300) -> torch.Tensor:
    """1-D k-means (Lloyd–Max) on samples, initialised at quantiles; returns sorted levels."""
    x, _ = torch.sort(samples.double())
    n = x.numel()
    prefix = torch.cat([torch.zeros(1, dtype=x.dtype), torch.cumsum(x, 0)])
    c = x[((torch.arange(levels, dtype=torch.float64) + 0.5) / levels * n).long()]
    for _ in range(iters):
        edges = torch.searchsorted(x, (c[1:] + c[:-1]) / 2)
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), edges, torch.tensor([n])])
        counts = (bounds[1:] - bounds[:-1]).clamp(min=1)
        new = (prefix[bounds[1:]] - prefix[bounds[:-1]]) / counts
        if torch.allclose(new, c, atol=1e-10, rtol=0):
            c = new
            break
        c = new
    return c.float()


def nearest(points: torch.Tensor, centroids: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) for each row of `points`."""
    c2 = (centroids * centroids).sum(-1)
    out = torch.empty(points.shape[0], dtype=torch.long, device=points.device)
    for i in range(0, points.shape[0], chunk):
        p = points[i : i + chunk]
        out[i : i + chunk] = torch.addmm(c2, p, centroids.T, alpha=-2).argmin(-1)
    return out


def kmeans(samples: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means from a random subset of the samples (deterministic for a generator)."""
    init = torch.randperm(samples.shape[0], generator=generator)[:k]
    c = samples[init.to(samples.device)].clone()
    for _ in range(iters):
        idx = nearest(samples, c)
        sums = torch.zeros_like(c).index_add_(0, idx, samples)
        counts = torch.bincount(idx, minlength=k).unsqueeze(-1)
        empty = counts.squeeze(-1) == 0
        c = torch.where(counts > 0, sums / counts.clamp(min=1), c)
        if empty.any():  # re-seed empty clusters on random samples
            pick = torch.randint(samples.shape[0], (int(empty.sum()),), generator=generator)
            c[empty] = samples[pick.to(samples.device)]
    return c
