"""The resume files of an unfinished calibration, next to OUTPUT: OUTPUT.partial.json (the run's
header, the layers measured so far, the timing of earlier sessions) and OUTPUT.tokens.safetensors
(the evaluation tokens, so that a resumed run measures on exactly the same set)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qpalette.errors import CalibrationError
from qpalette.fileio import atomic_write_json

PARTIAL_FORMAT = "qpalette.sensitivity-partial/1"
# header keys that must match for a run to be resumed
RESUME_KEYS = ("model", "protocol", "source", "seq_len", "levels", "t_max", "seed", "layer_filter",
               "directions", "loss")


@dataclass
class PartialRun:
    partial_path: Path
    tokens_path: Path
    header: dict | None = None
    layers: dict[str, dict] = field(default_factory=dict)  # name → measured layer entry
    timing: dict = field(default_factory=dict)  # every session's so far, saved with every layer
    timing_prev: dict = field(default_factory=dict)  # the earlier sessions'
    session_start: float = field(default_factory=time.perf_counter)
    tokens: torch.Tensor | None = None

    @classmethod
    def next_to(cls, output: Path) -> PartialRun:
        return cls(output.with_name(output.name + ".partial.json"),
                   output.with_name(output.name + ".tokens.safetensors"))

    def exists(self) -> bool:
        return self.partial_path.exists()

    def load(self) -> None:
        """Read both files (the run to continue)."""
        from safetensors.torch import load_file

        try:
            partial = json.loads(self.partial_path.read_text())
            tokens = load_file(str(self.tokens_path))["tokens"]
        except Exception as e:
            raise CalibrationError(
                f"cannot read the resume files {self.partial_path}, {self.tokens_path}: {e}") from None
        if partial.get("format") != PARTIAL_FORMAT:
            raise CalibrationError(f"{self.partial_path} is not a qpalette resume file")
        self.header, self.layers = partial["header"], partial["layers"]
        self.timing_prev = partial.get("timing", {})
        self.tokens = tokens

    def check_settings(self, want: dict) -> None:
        """Refuse to continue a run whose header differs from `want` in a RESUME_KEYS key."""
        diff = [k for k in RESUME_KEYS if self.header.get(k) != want.get(k)]
        if diff:
            raise CalibrationError(
                "--resume: the unfinished run used other settings ("
                + ", ".join(f"{k}={self.header.get(k)!r} vs {want.get(k)!r}" for k in diff)
                + "); use the same options or delete " + str(self.partial_path))

    def start(self, header: dict, tokens: torch.Tensor) -> None:
        """A new run: write the tokens, then an empty partial file."""
        from safetensors.torch import save_file

        tmp = str(self.tokens_path) + ".tmp"
        save_file({"tokens": tokens.contiguous()}, tmp, metadata={"header": json.dumps(header)})
        os.replace(tmp, self.tokens_path)
        self.header, self.tokens = header, tokens
        self.save()

    def clock(self, layers_s: float, peak_gpu_bytes: int | None) -> None:
        """Add this session's seconds (its layers', and the whole session's until now) to the
        earlier sessions' in `timing`, so that an interrupted session's time is kept too; the peak
        GPU allocation is the largest of every session's."""
        prev = self.timing_prev
        self.timing["layers_s"] = round(prev.get("layers_s", 0.0) + layers_s, 3)
        self.timing["total_s"] = round(prev.get("total_s", 0.0) + time.perf_counter() - self.session_start, 3)
        peaks = [p for p in (prev.get("peak_gpu_bytes"), peak_gpu_bytes) if p is not None]
        self.timing["peak_gpu_bytes"] = max(peaks) if peaks else None

    def save(self) -> None:
        doc = {"format": PARTIAL_FORMAT, "header": self.header, "layers": self.layers}
        if self.timing:
            doc["timing"] = self.timing
        atomic_write_json(self.partial_path, doc)

    def remove(self) -> None:
        for p in (self.partial_path, self.tokens_path):
            p.unlink(missing_ok=True)
