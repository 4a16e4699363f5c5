"""Progress of long work: a tqdm bar on a terminal; in a log file (stderr not a terminal), one
plain line every 10% (and at the end) instead of a redraw per step; nothing with --quiet."""

from __future__ import annotations

import sys
import time

LOG_STEP = 0.10  # fraction of the work between two lines in a log file


def progress_bar(total: int, desc: str, unit: str, enabled: bool, smoothing: float = 0.05, initial: int = 0,
                 position: int = 0):
    """An object with tqdm's update / set_postfix_str / close (and `with`); `position`: the line of
    a terminal it takes (one per process of a run on several devices)."""
    from tqdm import tqdm

    if enabled and not _terminal():
        return LogProgress(total, desc, unit, initial)
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True,
                smoothing=smoothing, initial=initial, position=position)


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class LogProgress:
    """Progress as lines for a log file: `calibrate: 30% (253/844 eval), 2:05 elapsed, ~4:50 left`."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.postfix = ""
        self._start, self._start_n = time.monotonic(), initial
        self._next = (int(initial / total / LOG_STEP) + 1) * LOG_STEP if total else 1.0
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.total and self.n / self.total >= self._next - 1e-12:
            self._line()
            while self._next <= self.n / self.total + 1e-12:
                self._next += LOG_STEP

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        if not self._closed and self.total and self.n < self.total and self.n > self._start_n:
            self._line()  # stopped early: say where
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self) -> None:
        spent = time.monotonic() - self._start
        done = self.n - self._start_n
        left = spent / done * (self.total - self.n) if done > 0 and self.n < self.total else None
        text = (f"{self.desc}: {100 * self.n / self.total:.0f}% ({self.n}/{self.total} {self.unit}), "
                f"{_clock(spent)} elapsed" + (f", ~{_clock(left)} left" if left is not None else "")
                + (f" [{self.postfix}]" if self.postfix else ""))
        print(text, file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def quiet_library_bars() -> None:
    """transformers' own bars ("Loading weights") redraw per step too: off when not on a terminal."""
    if not _terminal():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
