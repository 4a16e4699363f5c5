"""Progress output: a bar on a terminal, a few plain lines in a log file, nothing with --quiet."""

from __future__ import annotations

import subprocess
import sys

from qpalette.progress import LogProgress, progress_bar


def test_log_file_gets_a_line_every_ten_percent(capsys):
    bar = progress_bar(844, "calibrate", "eval", True)  # pytest's stderr is not a terminal
    assert isinstance(bar, LogProgress)
    with bar:
        for _ in range(844):
            bar.update(1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("calibrate: 10% (85/844 eval)") and "left" in lines[0]
    assert lines[-1].startswith("calibrate: 100% (844/844 eval)")


def test_resumed_and_stopped_early(capsys):
    with progress_bar(10, "compress", "shard", True, initial=4) as bar:  # 4 of 10 shards already written
        bar.update(1)  # 50%
        bar.set_postfix_str("layers.5.mlp")
        bar.update(1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("compress: 50% (5/10 shard)")
    assert lines[-1].startswith("compress: 60% (6/10 shard)") and lines[-1].endswith("[layers.5.mlp]")


def test_quiet_prints_nothing(capsys):
    with progress_bar(100, "x", "it", False) as bar:
        for _ in range(100):
            bar.update(1)
    assert capsys.readouterr().err == ""


def test_calibrate_into_a_log_file_stays_short(tiny_llama_dir, tmp_path):
    """The whole command, stderr redirected to a file: a handful of lines, no redraws, no
    transformers weight-loading bar."""
    log = tmp_path / "calibrate.log"
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, "-m", "qpalette.cli", "calibrate", str(tiny_llama_dir), "-o",
                              str(tmp_path / "s.json"), "--num-seqs", "4", "--seq-len", "32", "--levels", "4",
                              "--device", "cpu"], stderr=f, stdout=subprocess.DEVNULL)
    text = log.read_text()
    assert res.returncode == 0, text
    assert "\r" not in text and "Loading weights" not in text
    assert len(text.splitlines()) <= 30 and "calibrate: 100%" in text


LONG_RUN = """
import sys
from qpalette import progress
from qpalette.cli import app

class Clock:  # 0.7 s a step: the 900 evaluations below take 10.5 minutes
    now = 0.0
    def monotonic(self):
        return Clock.now

real_update = progress.LogProgress.update
def update(self, n=1):
    Clock.now += 0.7 * n
    real_update(self, n)

progress.time, progress.LogProgress.update = Clock(), update
app(sys.argv[1:], prog_name="qpalette")
"""


def test_a_ten_minute_calibrate_into_a_log_file_stays_under_100_lines(tiny_llama_dir, tmp_path):
    """A long calibrate (900 evaluations, as many redraws as the ~840 a SmolLM2 log used to hold,
    its clock running past 10 minutes) with stdout and stderr in one file: at most 100 lines."""
    log = tmp_path / "calibrate.log"
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, "-c", LONG_RUN, "calibrate", str(tiny_llama_dir), "-o",
                              str(tmp_path / "s.json"), "--num-seqs", "4", "--seq-len", "16", "--levels", "60",
                              "--device", "cpu"], stderr=f, stdout=f)
    text = log.read_text()
    assert res.returncode == 0, text
    assert "\r" not in text and "calibrate: 100% (900/900 eval), 10:" in text
    assert len(text.splitlines()) <= 100
