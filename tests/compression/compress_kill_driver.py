"""Test helper run as a child process: compress, SIGKILLed at one point of the run.

    python compress_kill_driver.py SRC OUT SCHEME POINT

POINT: `first` (before the first shard is made), `mid` (half a shard's temporary file written),
`between` (after the first shard and its manifest), `rename` (everything written, before
OUT.partial becomes OUT).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from qpalette.compression import writer
from qpalette.compression.writer import CompressOptions, compress


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(src: str, out: str, scheme: str, point: str) -> None:
    calls = {"n": 0}
    real_tensors, real_write, real_replace = writer.shard_tensors, writer.atomic_write, os.replace

    def tensors(*args):
        calls["n"] += 1
        if (point == "first" and calls["n"] == 1) or (point == "between" and calls["n"] == 2):
            die()
        return real_tensors(*args)

    def write(path, data):
        if point == "mid" and Path(path).name.startswith("model-"):
            tmp = Path(path).with_name(f".{Path(path).name}.killed.tmp")
            tmp.write_bytes(data[: len(data) // 2])
            die()
        return real_write(path, data)

    def replace(a, b):
        if point == "rename" and str(a).endswith(".partial"):
            die()
        return real_replace(a, b)

    writer.shard_tensors, writer.atomic_write = tensors, write
    writer.os.replace = replace
    compress(CompressOptions(model=src, output=Path(out), scheme=scheme, quiet=True), log=lambda m: None)


if __name__ == "__main__":
    main(*sys.argv[1:5])
