"""What `--device` and `--dtype` mean, checked against this machine: the one resolver of each."""

from __future__ import annotations

import contextlib
import re

import torch

from qpalette.errors import InputError

DTYPE_NAMES = ("auto", "float32", "tf32", "float16", "bfloat16")
_DTYPES = {"float32": torch.float32, "tf32": torch.float32, "float16": torch.float16,
           "bfloat16": torch.bfloat16}


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _one_device(spec: str) -> torch.device:
    if spec == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if not m:
        raise InputError(f"bad --device '{spec}': use auto, cpu, cuda or cuda:N")
    n = _visible_gpus()
    if not n:
        raise InputError(f"--device {spec} asked for, but no CUDA GPU is visible")
    if m[1] is not None and int(m[1]) >= n:
        raise InputError(f"--device {spec}: only {n} CUDA GPU(s) visible")
    return torch.device(spec)


def resolve_device(spec: str) -> torch.device:
    """auto (cuda if available, else cpu) | cpu | cuda | cuda:N."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if _visible_gpus() else "cpu")
    return _one_device(spec)


def resolve_devices(spec: str) -> list[torch.device]:
    """Several workers: auto (every GPU, else cpu) | cpu | cuda (every GPU) | cuda:0,cuda:1 | cpu,cpu."""
    spec = spec.strip().lower()
    n = _visible_gpus()
    if spec == "auto":
        return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
    if spec == "cuda":
        _one_device("cuda")
        return [torch.device(f"cuda:{i}") for i in range(n)]
    return [_one_device(part.strip()) for part in spec.split(",")]


def resolve_dtype(name: str, device: torch.device, auto_cuda: str = "float16") -> torch.dtype:
    """auto (float32 on CPU, `auto_cuda` on CUDA) | float32 | tf32 | float16 | bfloat16.

    tf32 is float32 storage with TensorFloat-32 matmuls: choosing it (or float32) sets torch's
    matmul precision for the process."""
    name = name.strip().lower()
    if name not in DTYPE_NAMES:
        raise InputError(f"bad --dtype '{name}': use {', '.join(DTYPE_NAMES)}")
    if name == "auto":
        name = auto_cuda if device.type == "cuda" else "float32"
    if name in ("tf32", "float32"):
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        torch.backends.cudnn.allow_tf32 = name == "tf32"
    return _DTYPES[name]


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """TensorFloat-32 matmuls (cuBLAS and cuDNN) on or off inside the block, the caller's settings
    back after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def peak_gpu_bytes(devices: list[torch.device]) -> int | None:
    """The largest of torch's peak allocations on these devices (None without a GPU among them):
    what a run needed, unlike the card-sized pools a run may reserve."""
    peaks = [torch.cuda.max_memory_allocated(d) for d in devices if d.type == "cuda"]
    return max(peaks) if peaks else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(spec: str) -> int:
    """Bytes of a --max-memory size: 20GiB, 80GB, 512MiB (KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB
    of 1024, B bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", spec)
    if not m or m[2].lower() not in _BYTE_UNITS or float(m[1]) <= 0:
        raise InputError(f"bad --max-memory '{spec}': a positive size such as 20GiB, 80GB or 512MiB")
    return int(float(m[1]) * _BYTE_UNITS[m[2].lower()])
