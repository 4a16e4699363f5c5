"""Fault injection into compress: SIGKILL at every point of a run, a full disk, an out-of-memory
GPU. Each time nothing half-written is left that looks like a checkpoint, and --resume finishes
with shards byte-identical to an uninterrupted run's."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_compress

from qpalette.compression import writer
from qpalette.errors import CompressError

DRIVER = Path(__file__).with_name("compress_kill_driver.py")
SCHEME = "vq-3.0"


@pytest.fixture(scope="module")
def whole(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "q"
    run_compress(tiny_llama_dir, out, scheme=SCHEME)
    return out


def same_shards(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names == sorted(p.name for p in b.glob("*.safetensors")) and names
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert (a / "model.safetensors.index.json").read_bytes() == (b / "model.safetensors.index.json").read_bytes()


@pytest.mark.parametrize("point", ["first", "mid", "between", "rename"])
def test_sigkill_then_resume_is_byte_identical(tiny_llama_dir, whole, tmp_path, point):
    out = tmp_path / "q"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(DRIVER), str(tiny_llama_dir), str(out), SCHEME, point],
                         env=env, capture_output=True, text=True)
    assert res.returncode == -9, res.stderr  # killed, not finished
    assert not out.exists() and (tmp_path / "q.partial").is_dir()
    if point != "rename":  # before the rename, OUT.partial is complete but is not OUT
        assert not (tmp_path / "q.partial" / "config.json").exists()
    rep = run_compress(tiny_llama_dir, out, scheme=SCHEME, resume=True)
    assert rep["resumed"] or point in ("first", "mid")  # no shard had been finished
    same_shards(whole, out)
    assert not (tmp_path / "q.partial").exists() and not list(out.glob(".*.tmp"))
    assert not (tmp_path / "q.lock").exists()


@pytest.mark.parametrize("fault", ["disk_full", "gpu_oom"])
def test_full_disk_or_gpu_memory_is_one_line_and_resumes(tiny_llama_dir, whole, tmp_path, monkeypatch, fault):
    real_write, real_tensors, calls = writer.atomic_write, writer.shard_tensors, {"n": 0}

    def full_disk(path, data):
        if Path(path).name.startswith("model-00002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data)

    def oom(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_tensors(*args)

    with monkeypatch.context() as m:
        if fault == "disk_full":
            m.setattr(writer, "atomic_write", full_disk)
        else:
            m.setattr(writer, "shard_tensors", oom)
        with pytest.raises(CompressError) as err:
            run_compress(tiny_llama_dir, tmp_path / "q", scheme=SCHEME)
    msg = str(err.value)
    assert "\n" not in msg and "--resume" in msg
    assert ("No space left" in msg) if fault == "disk_full" else ("out of GPU memory" in msg and "--device cpu" in msg)
    assert not (tmp_path / "q").exists()
    rep = run_compress(tiny_llama_dir, tmp_path / "q", scheme=SCHEME, resume=True)
    assert rep["resumed"]
    same_shards(whole, tmp_path / "q")
