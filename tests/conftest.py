import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test on CPU, and on CUDA under `pytest -m gpu` (device tool)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device(request.param)
