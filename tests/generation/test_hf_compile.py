"""How transformers' generate compiles and stops (qpalette.generation.hf_compile)."""

import pytest
import torch

from qpalette.generation.hf_compile import (
    MODES,
    compile_config,
    compile_kwargs,
    deferred_stop_check,
    mode_stop_check,
)
from qpalette.runtime.loading import load_model

CUDA = torch.device("cuda")


def test_every_mode_has_compile_arguments():
    for mode in MODES:
        assert compile_kwargs(mode) and compile_config(mode) is not None
    assert compile_kwargs("deferred") == compile_kwargs("lean")
    with pytest.raises(ValueError):
        compile_kwargs("fast")


def test_deferred_stop_check_is_switched_on_for_cuda_only_inside_the_block():
    from transformers.generation.utils import DeferredStopCheck

    assert not DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=False)
    with deferred_stop_check() as on:
        assert on
        assert DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=False)
        assert not DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=True)
        assert not DeferredStopCheck.is_supported(torch.device("cpu"), None, False, is_assistant=False)
    assert not DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=False)
    with deferred_stop_check(enabled=False) as on:
        assert not on and not DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=False)



def test_each_mode_runs_generate_under_its_stop_check():
    from transformers.generation.utils import DeferredStopCheck

    for mode, deferred in (("default", False), ("lean", False), ("deferred", True), ("plain", False)):
        with mode_stop_check(mode):
            assert DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=False) == deferred
    with mode_stop_check("plain"), deferred_stop_check() as on:  # plain leaves the choice to whoever makes it
        assert on and DeferredStopCheck.is_supported(CUDA, None, False, is_assistant=False)


@pytest.mark.gpu
def test_deferred_generate_gives_the_same_tokens_and_stops_at_eos(tiny_llama_dir):
    """One step late on the host, the same sequences: greedy to max length, and a batch where EOS
    (the token greedy decoding emits third) ends one sequence early."""
    model, _ = load_model(tiny_llama_dir, "cuda", torch.float16)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0,
              compile_config=compile_config("deferred"))
    want = model.generate(ids, **kw)
    eos = int(want[0, 7 + 2])
    want_eos = model.generate(ids, eos_token_id=eos, **kw)
    with deferred_stop_check() as on:
        assert on
        got = model.generate(ids, **kw)
        got_eos = model.generate(ids, eos_token_id=eos, **kw)
    assert torch.equal(got, want) and torch.equal(got_eos, want_eos)


@pytest.mark.gpu
def test_a_compressed_model_generates_the_same_tokens_with_its_own_deferred_stop(tiny_llama_dir, tmp_path):
    """`model.generate` as a user calls it (the stop check deferred by the loaded model itself)
    equals transformers' generate waiting for the GPU every token, with and without an early EOS."""
    from helpers import run_compress

    torch._dynamo.reset()  # the lean code compiled by the test before, unguarded on modules, would be reused
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    model, _ = load_model(tmp_path / "q", "cuda", torch.float16)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0)
    with deferred_stop_check(False):
        want = model.generate(ids, **kw)
        want_eos = model.generate(ids, eos_token_id=int(want[0, 7 + 2]), **kw)
    assert torch.equal(model.generate(ids, **kw), want)
    assert torch.equal(model.generate(ids, eos_token_id=int(want[0, 7 + 2]), **kw), want_eos)
