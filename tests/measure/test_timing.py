"""qpalette.measure.timing without a GPU: the calls a fused-block timing replays, run on the reference."""

from __future__ import annotations

import pytest
import torch

from qpalette.errors import InputError
from qpalette.measure import timing
from qpalette.quant.incoherence import pack_signs, random_signs
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes


def _layers(name: str, rows: int, cols: int, copies: int = 2) -> list:
    gen = torch.Generator().manual_seed(3)
    return [lanes.pack(name, get_quantizer(name).random_tensors(rows, cols, gen, "cpu")) for _ in range(copies)]


@pytest.mark.parametrize("form", timing.BLOCK_FORMS)
def test_a_call_a_weight_copy_with_the_forms_inputs(form):
    rows, cols, m = 32, 256, 3
    layers = _layers("tcq-2.0", rows, cols)
    signs = pack_signs(random_signs(cols, seed=0))
    calls = timing.fused_layer_calls("tcq-2.0", layers, (rows, cols), signs, m, form, torch.float32)
    assert len(calls) == len(layers)
    outs = [c() for c in calls]
    if form in ("norm", "add_norm"):  # normed_rotated_matmul: (y, h), h = x + residual only with one
        hs = [h for _, h in outs]
        assert all(h is None for h in hs) if form == "norm" else all(h.shape == (m, cols) for h in hs)
        outs = [y for y, _ in outs]
    assert all(y.shape == (m, rows) for y in outs)
    assert not torch.equal(outs[0], outs[1])  # each call reads its own weight copy


def test_an_unknown_form_is_refused():
    layers = _layers("tcq-2.0", 16, 128, copies=1)
    with pytest.raises(InputError, match="unknown block form"):
        timing.fused_layer_calls("tcq-2.0", layers, (16, 128), pack_signs(random_signs(128, seed=0)), 1, "silu")
