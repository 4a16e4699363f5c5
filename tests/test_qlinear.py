import pytest
import torch
from torch import nn

from qpalette.incoherence import unpack_signs, unrotate_weight
from qpalette.qlinear import QuantizedLinear

ENTRIES = ["nuq-3", "vq-2.5", "tcq-2.0", "half-tcq-3.25"]


@pytest.mark.parametrize("name", ENTRIES)
def test_forward_equals_simulated_layer(name, device):
    """The quantized layer computes what the original architecture computes with the
    dequantized, un-rotated weight (the "simulated" model of the compress issue)."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(576, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 576, generator=g) * 0.02)
    q = QuantizedLinear.from_float(lin, name, seed=5).to(device)
    w_sim = unrotate_weight(q.rotated_weight(), unpack_signs(q.signs))
    x = torch.randn(3, 7, 576, generator=g).to(device)
    expect = x @ w_sim.T + q.bias
    got = q(x)
    assert got.shape == (3, 7, 64)
    assert torch.allclose(got, expect, rtol=1e-4, atol=1e-5)
    # and it is close to the float layer (quantization error only)
    ref = lin.to(device)(x)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 4 * 2 ** (-q.quantizer.bits)


def test_buffers_match_tensor_specs_and_load_round_trip():
    lin = nn.Linear(128, 32, bias=False)
    q = QuantizedLinear.from_float(lin, "half-tcq-2.25", seed=1)
    specs = q.quantizer.tensor_specs(32, 128)
    sd = q.state_dict()
    assert set(sd) == set(specs) | {"signs"}
    for k, (shape, dtype) in specs.items():
        assert (tuple(sd[k].shape), sd[k].dtype) == (shape, dtype)
    empty = QuantizedLinear(128, 32, "half-tcq-2.25")
    empty.load_state_dict(sd)
    x = torch.randn(2, 128)
    assert torch.equal(empty(x), q(x))
    assert not isinstance(q, nn.Linear)


def test_half_precision_inputs_keep_their_dtype():
    q = QuantizedLinear.from_float(nn.Linear(64, 16), "nuq-4", seed=0)
    for dt in (torch.float16, torch.bfloat16):
        assert q(torch.randn(4, 64).to(dt)).dtype == dt
