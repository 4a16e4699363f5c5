"""What a command's `--device` means: auto | cpu | cuda | cuda:N, checked against this machine."""

from __future__ import annotations

import torch


def resolve_device(spec: str, error: type[Exception] = ValueError) -> torch.device:
    """auto (cuda if available, else cpu) | cpu | cuda | cuda:N; anything else, or a GPU this
    machine lacks, raises `error` (the calling command's user-facing error) with a message."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise error(f"--device {spec} asked for, but no CUDA GPU is visible")
        try:
            dev = torch.device(spec)
        except RuntimeError:
            raise error(f"bad --device '{spec}': use auto, cpu, cuda or cuda:N") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise error(f"--device {spec}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
        return dev
    raise error(f"bad --device '{spec}': use auto, cpu, cuda or cuda:N")
