"""Test helper run as a child process: `qpalette hessians`, SIGKILLed at one point of the run.

    python hessians_kill_driver.py MODEL TEXT OUT POINT

POINT: `first_block` (inside block 0's forward pass, no file written yet), `mid_file` (while the
second block's file is being written: its temporary file half full), `between` (after the second
file), `final` (every file written, before the manifest).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from qpalette.calibration import hessians
from qpalette.calibration.hessians import HessianOptions, collect_hessians

OPTIONS = dict(tokens=1024, seq_len=64, batch_size=3, device="cpu", progress=False)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(model: str, text: str, out: str, point: str) -> None:
    real_run, real_write, real_json = hessians._run_block, hessians.write_file, hessians.atomic_write_json
    written = []

    def run_block(stream, j, *args):
        if point == "first_block" and j == 0:
            die()
        return real_run(stream, j, *args)

    def write_file(path, hs, header):
        if point == "mid_file" and len(written) == 1:
            Path(path).with_name(f".{Path(path).name}.killed.tmp").write_bytes(b"half a file")
            die()
        digest = real_write(path, hs, header)
        written.append(path)
        if point == "between" and len(written) == 2:
            die()
        return digest

    def write_json(path, doc):
        if point == "final" and Path(path).name == hessians.MANIFEST:
            die()
        return real_json(path, doc)

    hessians._run_block, hessians.write_file, hessians.atomic_write_json = run_block, write_file, write_json
    collect_hessians(HessianOptions(model=model, output=Path(out), text_file=text, **OPTIONS), log=lambda m: None)


if __name__ == "__main__":
    main(*sys.argv[1:5])
