import pytest
import torch

from qpalette.quant.rtn import rtn_bits, rtn_fake_quantize


@pytest.mark.parametrize("cols", [256, 576])
def test_rtn_levels_and_error(cols):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, cols, generator=g)
    q = rtn_fake_quantize(w, bits=4, group=128)
    assert q.shape == w.shape
    for grp in q.split(128, dim=1):  # at most 16 distinct values per row of each group
        assert all(len(torch.unique(r)) <= 16 for r in grp)
    nmse = ((q - w) ** 2).sum() / (w**2).sum()
    assert 0.003 < nmse < 0.02  # 4-bit uniform on Gaussian groups (min-max range)


def test_rtn_bits():
    assert rtn_bits(4, 128, 4096) == 4.25
    assert rtn_bits(4, 128, 576) == pytest.approx(4 + 5 * 32 / 576)
