"""Helpers shared by several test modules (tests never import one another)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qpalette.compression.writer import CompressOptions, compress


def run_compress(src, out, **kw) -> dict:
    return compress(CompressOptions(model=str(src), output=Path(out), quiet=True, **kw), log=lambda m: None)


def fake_sensitivity(model_dir, path):
    from qpalette.models.topology import linear_layers, load_config

    layers = linear_layers(load_config(model_dir))
    g = torch.Generator().manual_seed(1)
    doc = {"format": "qpalette.sensitivity/1", "model": str(model_dir), "protocol": "test",
           "tokens": None, "layers": {
               l.name: {"a": float(torch.rand(1, generator=g)) + 0.1, "r2": None,
                        "shape": [l.out_features, l.in_features]} for l in layers}}
    path.write_text(json.dumps(doc))
    return path
