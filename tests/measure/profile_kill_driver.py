"""Test helper: `qpalette profile` without a GPU (deterministic fake timings), SIGKILLed at one point.

    python profile_kill_driver.py MODEL OUT_DIR POINT

POINT: `constant` (while the first constant is measured, nothing saved), `mid_shape` (inside the
second shape's entries), `between` (after the second shape is saved), `final` (the first output
file written, not the second).
"""

from __future__ import annotations

import os
import signal
import sys
import zlib
from pathlib import Path

from qpalette.measure import profile

BATCH_SIZES, ENTRIES = [1, 8], ["nuq-4", "vq-2.0", "tcq-2.0"]


def fake_timing(name: str, rows: int, cols: int, batch_sizes, dtype):
    return {m: zlib.crc32(f"{name}{rows}x{cols}b{m}".encode()) * 1e-15 for m in batch_sizes}, None


def fake_gpu(setattr_) -> None:
    """Replace what needs a GPU by deterministic stand-ins (`setattr_`: setattr or monkeypatch's)."""
    setattr_(profile, "_require_kernels", lambda: None)
    setattr_(profile.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    setattr_(profile, "measure_constant", lambda cfg, m, dtype, say: (1e-3 * m, {"fp16_step_s": 2e-3 * m}))
    setattr_(profile.kernel_timing, "time_quantized", fake_timing)


def run(model: str, out: str, resume: bool = False) -> list[Path]:
    return profile.run_profile(model, BATCH_SIZES, out, ENTRIES, name="tiny", resume=resume, say=lambda m: None)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(model: str, out: str, point: str) -> None:
    fake_gpu(setattr)
    timed, shapes, outputs = [], [], []
    real_const, real_time = profile.measure_constant, profile.kernel_timing.time_quantized
    real_add, real_write = profile.PartialProfile.add_shape, profile.atomic_write

    def constant(*args):
        if point == "constant":
            die()
        return real_const(*args)

    def time_quantized(*args):
        timed.append(args)
        if point == "mid_shape" and len(shapes) == 1 and len(timed) > len(ENTRIES) + 1:
            die()
        return real_time(*args)

    def add_shape(self, shape, timings):
        real_add(self, shape, timings)
        shapes.append(shape)
        if point == "between" and len(shapes) == 2:
            die()

    def write(path, data):
        if point == "final" and Path(path).name.startswith("latency_") and ".partial" not in Path(path).name:
            if outputs:
                die()
            outputs.append(path)
        return real_write(path, data)

    profile.measure_constant, profile.kernel_timing.time_quantized = constant, time_quantized
    profile.PartialProfile.add_shape, profile.atomic_write = add_shape, write
    run(model, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
