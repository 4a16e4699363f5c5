"""Build and load the CUDA kernels (sources in qpalette/runtime/cuda/) on first use.

The extension is compiled with torch.utils.cpp_extension for the compute capability of the GPU
at hand (sm_80 or newer: cp.async and mma.m16n8k16) into `$QPALETTE_CACHE/kernels` (default
`~/.cache/qpalette/kernels`), one folder per hash of the sources, architecture and torch build,
so a later process loads it without compiling. CPU-only installs never touch this module's build.
`QPALETTE_KERNELS=0` turns the kernels off (the ops fall back to the PyTorch reference); with
them on, a failed build stops with a KernelError saying how to fix it (never a silent fallback);
`QPALETTE_KERNELS_VERBOSE=1` shows the compiler's output.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from qpalette.errors import KernelError

SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


def source_dir() -> Path:
    """The CUDA sources, shipped beside this module (qpalette/runtime/cuda/)."""
    return Path(__file__).resolve().parent / "cuda"


def cache_dir() -> Path:
    root = os.environ.get("QPALETTE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qpalette")
    return Path(root) / "kernels"


def sources(folder: Path | None = None) -> list[Path]:
    folder = folder or source_dir()
    return sorted(p for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES)


def _digest(files: list[Path], arch: str) -> str:
    import torch

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(f"{arch}|{torch.__version__}|{torch.version.cuda}".encode())
    return h.hexdigest()[:16]


def arch_of(device=None) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


@functools.lru_cache(maxsize=None)
def _load(arch: str):
    from torch.utils import cpp_extension

    if int(arch) < 80:
        raise KernelError(f"the qpalette kernels need compute capability 8.0 or newer (this GPU: sm_{arch}); "
                          "set QPALETTE_KERNELS=0 to run the slow PyTorch reference path")
    files = sources()
    name = f"qpalette_kernels_{_digest(files, arch)}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    compiled = [str(f) for f in files if f.suffix in (".cu", ".cpp")]
    verbose = os.environ.get("QPALETTE_KERNELS_VERBOSE", "") not in ("", "0")
    try:
        return cpp_extension.load(
            name=name,
            sources=compiled,
            extra_cflags=["-O2", "-std=c++17"],
            extra_cuda_cflags=[
                "-O3",
                "-std=c++17",
                f"-gencode=arch=compute_{arch},code=sm_{arch}",
                "-lineinfo",
            ],
            build_directory=str(build),
            verbose=verbose,
        )
    except Exception as e:  # compiler missing, build error, …
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:300]
        raise KernelError(
            f"building the qpalette CUDA kernels for sm_{arch} failed ({first}); install the CUDA "
            f"toolkit (nvcc) and ninja matching torch's CUDA {_torch_cuda()} "
            "(QPALETTE_KERNELS_VERBOSE=1 shows the compiler's output), or set QPALETTE_KERNELS=0 to run "
            "the slow PyTorch reference path"
        ) from e


def _torch_cuda() -> str:
    import torch

    return str(torch.version.cuda)


def extension(device=None):
    """The compiled module for `device`'s architecture (builds on first use; raises KernelError)."""
    return _load(arch_of(device))


def available(device=None) -> bool:
    """True when the kernels are enabled and a CUDA device is present; raises KernelError (one line,
    with the fix) when they are enabled but cannot be built: silently running the reference path,
    orders of magnitude slower, would look like a working install."""
    if os.environ.get("QPALETTE_KERNELS", "1") == "0":
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    _load(arch_of(device))
    return True
