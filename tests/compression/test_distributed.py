"""`qpalette compress` on several devices: two CPU ranks (gloo), spawned by `--device cpu,cpu` or
by torchrun, write the same checkpoint byte for byte as one process; resume merges the ranks'
progress files; a user error on a rank is one message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compress_killed_at_second_shard, run_compress
from tiny_llama import make_tiny_llama

from qpalette.compression.writer import PROGRESS_FILE, RANK_PROGRESS
from qpalette.errors import CompressError

SAME = ("config.json", "model.safetensors.index.json")  # besides the shards


@pytest.fixture(scope="module")
def three_blocks(tmp_path_factory):
    """Three blocks and the rest: four shards, so two ranks write two each."""
    return make_tiny_llama(tmp_path_factory.mktemp("three_blocks"), num_hidden_layers=3)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in b.glob("*.safetensors"))
    for name in [*shards, *SAME]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not list(b.glob("qpalette-progress*"))


@pytest.mark.parametrize("scheme", ["nuq-3", "vq-2.5"])
def test_two_ranks_write_the_one_device_checkpoint(three_blocks, tmp_path, scheme):
    one = run_compress(three_blocks, tmp_path / "one", scheme=scheme, device="cpu")
    two = run_compress(three_blocks, tmp_path / "two", scheme=scheme, device="cpu,cpu")
    assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    assert [r["shards"] for r in two["ranks"]] == [2, 2] and two["device"] == "2× cpu"
    assert one["bytes"] == two["bytes"] and len(one["ranks"]) == 1


def test_resume_merges_the_ranks_progress_files(three_blocks, tmp_path, monkeypatch):
    run_compress(three_blocks, tmp_path / "whole", scheme="nuq-3")
    compress_killed_at_second_shard(three_blocks, tmp_path / "killed", monkeypatch, scheme="nuq-3")
    partial = tmp_path / "killed.partial"
    main = json.loads((partial / PROGRESS_FILE).read_text())
    assert len(main["shards"]) == 1  # as if rank 1 had written that shard: its record in its own file
    (partial / RANK_PROGRESS.format(rank=1)).write_text(json.dumps(main))
    (partial / PROGRESS_FILE).write_text(json.dumps({**main, "shards": {}}))
    rep = run_compress(three_blocks, tmp_path / "killed", scheme="nuq-3", device="cpu,cpu", resume=True)
    assert rep["resumed"] and sum(r["shards"] for r in rep["ranks"]) == 3
    assert_same_checkpoint(tmp_path / "whole", tmp_path / "killed")


def test_a_ranks_user_error_is_one_message(three_blocks, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    with pytest.raises(CompressError, match="already exists"):
        run_compress(three_blocks, tmp_path / "out", scheme="nuq-3", device="cpu,cpu")


def test_torchrun_ranks_write_the_one_device_checkpoint(three_blocks, tmp_path):
    run_compress(three_blocks, tmp_path / "one", scheme="nuq-3", device="cpu")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "qpalette", "compress", str(three_blocks), "--scheme", "nuq-3", "-o", str(tmp_path / "two"),
           "--device", "cpu", "--quiet"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    report = json.loads((tmp_path / "two" / "qpalette-compress.json").read_text())
    assert [r["shards"] for r in report["ranks"]] == [2, 2]


def test_compress_turns_tf32_off_and_gives_it_back(three_blocks, tmp_path, monkeypatch):
    """A process that calibrated first (TF32 on) writes the bytes of a fresh one: TF32 is off while
    the shards are made, and the caller's setting is back afterwards."""
    import torch

    from qpalette.compression import writer

    seen, real = [], writer.shard_tensors
    monkeypatch.setattr(writer, "shard_tensors", lambda *a: (seen.append(torch.backends.cuda.matmul.allow_tf32),
                                                             real(*a))[1])
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    run_compress(three_blocks, tmp_path / "q", scheme="nuq-3", device="cpu")
    assert seen and not any(seen) and torch.backends.cuda.matmul.allow_tf32
