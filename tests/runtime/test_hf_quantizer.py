"""transformers conventions: float32 on CUDA loads in the kernels' dtype with a warning, and
`device_map` places the model."""

import pytest
import torch
from helpers import run_compress

import qpalette  # noqa: F401  (registers the format)
from qpalette.runtime.hf_quantizer import QpaletteConfig, QpaletteHfQuantizer


def quantizer(device_map):
    q = QpaletteHfQuantizer(QpaletteConfig(), pre_quantized=True)
    q.validate_environment(device_map=device_map)
    return q


@pytest.mark.parametrize("device_map", ["cuda", "cuda:1", 0, {"": 0}, {"model": "cpu", "lm_head": "cuda:0"}])
def test_float32_on_cuda_becomes_float16_with_a_warning(device_map):
    with pytest.warns(UserWarning, match="loading in float16"):
        assert quantizer(device_map).update_dtype(torch.float32) == torch.float16


@pytest.mark.parametrize("device_map,dtype", [(None, torch.float32), ("cpu", torch.float32), ({"": "cpu"}, torch.float32),
                                              ("cuda", torch.bfloat16), ("cuda", torch.float16)])
def test_other_requests_keep_their_dtype(device_map, dtype, recwarn):
    assert quantizer(device_map).update_dtype(dtype) == dtype
    assert not recwarn.list


@pytest.fixture(scope="module")
def compressed(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hfq") / "q"
    run_compress(tiny_llama_dir, out, scheme="nuq-4")
    return out


def _logits(model, device):
    ids = torch.arange(1, 13, device=device).reshape(2, 6)
    with torch.no_grad():
        return model(ids).logits.float().cpu()


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, "auto"])
def test_device_map_on_cpu(compressed, device_map):
    from transformers import AutoModelForCausalLM

    if device_map == "auto" and torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu test covers auto")
    plain = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    mapped = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32, device_map=device_map)
    assert {t.device.type for t in mapped.state_dict().values()} == {"cpu"}
    assert torch.equal(_logits(mapped, "cpu"), _logits(plain, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("device_map", ["cuda", "auto", {"": 0}])
def test_device_map_on_cuda(compressed, device_map):
    """Every tensor lands on the GPU and the kernels give the logits of a model moved there."""
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    moved = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float16).to("cuda")
    mapped = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float16, device_map=device_map)
    assert {t.device.type for t in mapped.state_dict().values()} == {"cuda"}
    torch.testing.assert_close(_logits(mapped, "cuda"), _logits(moved, "cuda"), rtol=0, atol=0)
    with pytest.warns(UserWarning, match="loading in float16"):
        wide = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32, device_map=device_map)
    assert wide.dtype == torch.float16


def test_importing_the_quantizer_first_registers_it():
    """In a fresh interpreter, importing hf_quantizer is what first imports transformers (and
    fires qpalette's import hook mid-import): it still ends registered."""
    import subprocess
    import sys

    code = ("from qpalette.runtime.hf_quantizer import QpaletteConfig\n"
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
            "assert 'qpalette_llama.needs-import-qpalette' in CONFIG_MAPPING")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_loaded_model_generates_with_the_stop_check_deferred(compressed, monkeypatch):
    """Its generate is transformers' own, called with DeferredStopCheck on for CUDA, unless an
    enclosing deferred_stop_check block (as bench's timed modes) or QPALETTE_DEFERRED_STOP=0 says no;
    a deep copy's generate runs on the copy."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.generation.utils import DeferredStopCheck

    model = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    seen = []

    def generate(self, *args, **kwargs):
        seen.append((self, DeferredStopCheck.is_supported(torch.device("cuda"), None, False, is_assistant=False)))
        return "tokens"

    monkeypatch.setattr(type(model), "generate", generate)
    assert model.generate("ids") == "tokens" and seen[-1] == (model, True)
    with qpalette.deferred_stop_check(False):
        model.generate("ids")
    assert seen[-1] == (model, False)
    twin = copy.deepcopy(model)
    twin.generate("ids")
    assert seen[-1] == (twin, True)
    monkeypatch.setenv("QPALETTE_DEFERRED_STOP", "0")
    model.generate("ids")
    assert seen[-1] == (model, False)
    assert not DeferredStopCheck.is_supported(torch.device("cuda"), None, False, is_assistant=False)
