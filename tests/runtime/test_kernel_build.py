"""A CUDA machine where the kernels cannot be built stops with one line saying how to fix it."""

from __future__ import annotations

import pytest
import torch

from qpalette.errors import KernelError
from qpalette.runtime import kernel_build


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """torch sees a sm_90 GPU; the build is whatever the test makes `cpp_extension.load` do."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_build, "arch_of", lambda device=None: "90")
    monkeypatch.setenv("QPALETTE_CACHE", str(tmp_path))
    monkeypatch.delenv("QPALETTE_KERNELS", raising=False)
    kernel_build._load.cache_clear()
    yield cpp_extension
    kernel_build._load.cache_clear()


def test_failed_build_is_one_line_with_the_fix(fake_gpu, monkeypatch):
    def broken(**kw):
        raise RuntimeError("Ninja is required to load C++ extensions\n(long compiler log)")

    monkeypatch.setattr(fake_gpu, "load", broken)
    with pytest.raises(KernelError) as err:
        kernel_build.available()
    msg = str(err.value)
    assert "\n" not in msg and "Ninja is required" in msg and "long compiler log" not in msg
    assert "QPALETTE_KERNELS=0" in msg and "nvcc" in msg


def test_opt_out_never_builds(fake_gpu, monkeypatch):
    monkeypatch.setattr(fake_gpu, "load", lambda **kw: pytest.fail("built although QPALETTE_KERNELS=0"))
    monkeypatch.setenv("QPALETTE_KERNELS", "0")
    assert kernel_build.available() is False


def test_old_gpu_says_how_to_run(monkeypatch, fake_gpu):
    monkeypatch.setattr(kernel_build, "arch_of", lambda device=None: "75")
    with pytest.raises(KernelError, match="8.0 or newer.*QPALETTE_KERNELS=0"):
        kernel_build.available()


def test_cli_prints_the_build_failure_as_one_line(fake_gpu, monkeypatch, tiny_llama_dir):
    """`qpalette profile` on that machine: exit 2, the message, no traceback."""
    from typer.testing import CliRunner

    from qpalette.cli import app

    monkeypatch.setattr(fake_gpu, "load", lambda **kw: (_ for _ in ()).throw(OSError("nvcc: not found")))
    res = CliRunner().invoke(app, ["profile", str(tiny_llama_dir), "--batch-sizes", "1"])
    assert res.exit_code == 2, res.output
    assert "nvcc: not found" in res.output and "QPALETTE_KERNELS=0" in res.output
    assert "Traceback" not in res.output
