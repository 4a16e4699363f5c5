"""The progress bar of calibration runs and of sampling (tqdm, off with --quiet)."""

from __future__ import annotations


def progress_bar(total: int, desc: str, unit: str, enabled: bool, smoothing: float = 0.05):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True,
                smoothing=smoothing)
