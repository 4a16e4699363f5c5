"""Two GPUs (`pytest -m gpu` on a machine with at least two): compress over both writes the
one-GPU checkpoint; a compressed model split over both cards by `device_map` (max_memory capped
so that one card cannot hold it) gives the one-card logits and generates, through transformers'
generate and qpalette's decoder."""

from __future__ import annotations

import pytest
import torch
from helpers import run_compress
from tiny_llama import make_tiny_llama

from qpalette.generation import Decoder, SamplingOptions

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")


@pytest.fixture(scope="module")
def compressed(two_gpus, tmp_path_factory):
    """Four blocks compressed on cuda:0 and on cuda:0,cuda:1."""
    root = tmp_path_factory.mktemp("multi_gpu")
    src = make_tiny_llama(root / "src", num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    one = run_compress(src, root / "one", scheme="tcq-2.0", device="cuda:0")
    two = run_compress(src, root / "two", scheme="tcq-2.0", device="cuda:0,cuda:1")
    return root, one, two


def test_two_gpus_write_the_one_gpu_checkpoint(compressed):
    root, one, two = compressed
    assert [r["device"] for r in two["ranks"]] == ["cuda:0", "cuda:1"]
    shards = sorted(p.name for p in (root / "one").glob("*.safetensors"))
    for name in [*shards, "config.json", "model.safetensors.index.json"]:
        assert (root / "one" / name).read_bytes() == (root / "two" / name).read_bytes(), name


def _split(folder):
    """The model with its blocks over both cards: cuda:0 may hold only about half of it."""
    from transformers import AutoModelForCausalLM

    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16, device_map="auto",
                                                 max_memory={0: int(size * 0.55), 1: 4 * size})
    return model.eval()


def test_a_model_split_over_two_gpus_runs_and_generates(compressed):
    from transformers import AutoModelForCausalLM

    root = compressed[0]
    split = _split(root / "two")
    assert {p.device.index for p in split.parameters()} == {0, 1}
    whole = AutoModelForCausalLM.from_pretrained(root / "two", dtype=torch.float16).to("cuda:0").eval()
    ids = torch.arange(1, 25, device="cuda:0").reshape(2, 12)
    with torch.no_grad():
        a, b = split(ids).logits.float().cpu(), whole(ids).logits.float().cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    hf = split.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(hf.cpu(), whole.generate(ids, max_new_tokens=8, do_sample=False).cpu())
    dec = Decoder(split)
    out = dec.generate_ids([ids[0].tolist()], 8, SamplingOptions(), stop_at_eos=False)
    assert not out.graphs and out.tokens[0] == hf[0, 12:].tolist()



def test_graphs_on_the_second_gpu(compressed):
    """A model on cuda:1 (not the current device): the decoder captures its graphs there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(compressed[0] / "two", dtype=torch.float16).to("cuda:1").eval()
    prompt = list(range(1, 13))
    graphed = Decoder(model).generate_ids([prompt], 12, SamplingOptions(), stop_at_eos=False)
    eager = Decoder(model, graphs=False).generate_ids([prompt], 12, SamplingOptions(), stop_at_eos=False)
    assert graphed.graphs and graphed.tokens == eager.tokens
