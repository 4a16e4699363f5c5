"""Test helper run as a child process: calibrate, SIGKILLed at one point of the run.

    python calibrate_kill_driver.py MODEL OUT POINT

POINT: `sampling` (while the evaluation set is drawn), `mid_layer` (inside a layer's noise
levels), `between` (after the third layer is saved), `final` (everything measured, before the
output file is written); `rank1`, run under torchrun (two processes): rank 1 dies inside its
second layer, in the second round.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from qpalette.calibration import noise, resume, sensitivity
from qpalette.calibration.sensitivity import CalibrateOptions, calibrate

OPTIONS = dict(num_seqs=4, seq_len=32, levels=4, seed=0, devices=["cpu"], batch_size=2, progress=False)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(model: str, out: str, point: str) -> None:
    saves = {"n": 0}
    real_sample, real_kl, real_save, real_write = (sensitivity.sample_model, noise.BlockEvaluator.mean_kl,
                                                   resume.PartialRun.save, sensitivity.atomic_write_json)

    def sample(*args, **kw):
        if point == "sampling":
            die()
        return real_sample(*args, **kw)

    evals = {"n": 0}

    def mean_kl(self):
        evals["n"] += 1
        if point == "mid_layer" and saves["n"] == 2:
            die()
        if point == "rank1" and os.environ.get("RANK") == "1" and evals["n"] == OPTIONS["levels"] + 3:
            die()
        return real_kl(self)

    def save(self):
        real_save(self)
        saves["n"] += 1
        if point == "between" and saves["n"] == 3:
            die()

    def write(path, doc):
        if point == "final" and Path(path) == Path(out):
            die()
        return real_write(path, doc)

    sensitivity.sample_model, noise.BlockEvaluator.mean_kl = sample, mean_kl
    resume.PartialRun.save, sensitivity.atomic_write_json = save, write
    calibrate(CalibrateOptions(model=model, output=out, **OPTIONS), log=lambda m: None)


if __name__ == "__main__":
    main(*sys.argv[1:4])
