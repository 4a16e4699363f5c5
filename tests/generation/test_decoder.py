"""qpalette's decoder against transformers' generate, alone against batched, seeded sampling."""

import pytest
import torch
from helpers import run_compress

from qpalette.generation import Decoder, SamplingOptions
from qpalette.runtime.loading import load_model

GREEDY = SamplingOptions()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, disable_compile=True)
    return out[0, len(ids):].tolist()


def prompts_of(model, lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size - 1, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_q_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "tcq"
    run_compress(tiny_llama_dir, out, scheme="nuq-4")
    return out


def assert_greedy(model, prompt: list[int], tokens: list[int], tol: float) -> None:
    """Each token is the argmax, within `tol`, of the model's own logits over the prompt and the
    tokens before it (one teacher-forced forward): the check for float16, where a near-tie may
    fall either way between two correct attention paths and the sequences then part."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    picked = logits.gather(1, torch.tensor(tokens, device=model.device)[:, None])[:, 0]
    assert (logits.max(1).values - picked).max().item() <= tol


@pytest.mark.parametrize("which", ["original", "compressed"])
def test_greedy_equals_transformers_generate(which, tiny_llama_dir, tiny_q_dir, device):
    """float32: the very tokens of transformers' greedy generate. float16 (the kernels on CUDA):
    greedy under teacher forcing (assert_greedy)."""
    path = tiny_llama_dir if which == "original" else tiny_q_dir
    dtype = torch.float32 if which == "original" else None  # the kernels run float16 on CUDA
    model, _ = load_model(path, device, dtype, tokenizer=False)
    dec = Decoder(model)
    for prompt in prompts_of(model, (1, 7, 30)):
        mine = dec.generate_ids([prompt], 24, GREEDY, stop_at_eos=False)
        assert mine.steps == 23 and mine.graphs == (device.type == "cuda")
        if model.dtype == torch.float32:
            assert mine.tokens[0] == hf_greedy(model, prompt, 24)
        else:
            assert_greedy(model, prompt, mine.tokens[0], tol=0.05)


def test_batch_equals_alone_with_early_eos(tiny_llama_dir, device):
    """Different prompt lengths, a padded bucket (3 prompts in 4 rows) and an EOS that ends one
    sequence early: each sequence gets exactly the tokens it gets alone."""
    model, _ = load_model(tiny_llama_dir, device, torch.float32, tokenizer=False)
    dec = Decoder(model)
    prompts = prompts_of(model, (3, 11, 6), seed=1)
    free = dec.generate_ids(prompts, 16, GREEDY, stop_at_eos=False).tokens
    eos = free[1][4]  # sequence 1 ends at its 5th token (others may end too, where they meet it)
    batched = dec.generate_ids(prompts, 16, GREEDY, eos_ids=(eos,))
    assert batched.tokens[1] == free[1][:5] and batched.finished[1]
    for i, p in enumerate(prompts):
        alone = dec.generate_ids([p], 16, GREEDY, eos_ids=(eos,))
        assert batched.tokens[i] == alone.tokens[0]
        assert batched.finished[i] == alone.finished[0] == (eos in free[i])


def test_every_sequence_ended_stops_early(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, "cpu", tokenizer=False)
    dec = Decoder(model)
    p = prompts_of(model, (5,))
    first = dec.generate_ids(p, 10, GREEDY, stop_at_eos=False).tokens[0]
    r = dec.generate_ids(p, 10, GREEDY, eos_ids=(first[2],))
    assert r.tokens[0] == first[: first.index(first[2]) + 1] and r.finished == [True]
    assert r.steps < 9


def test_seeded_sampling_is_reproducible(tiny_llama_dir, device):
    model, _ = load_model(tiny_llama_dir, device, torch.float32, tokenizer=False)
    dec = Decoder(model)
    prompts = prompts_of(model, (4, 9), seed=2)

    def run(**kw):
        return dec.generate_ids(prompts, 20, SamplingOptions(**kw), stop_at_eos=False).tokens

    a = run(temperature=1.0, top_k=40, top_p=0.95, seed=7)
    assert a == run(temperature=1.0, top_k=40, top_p=0.95, seed=7)
    assert a != run(temperature=1.0, top_k=40, top_p=0.95, seed=8)
    assert a[0] != dec.generate_ids(prompts[:1], 20, GREEDY, stop_at_eos=False).tokens[0]
    greedy = dec.generate_ids(prompts, 20, GREEDY, stop_at_eos=False).tokens
    assert run(temperature=1.0, top_k=1, seed=3) == greedy  # top-1 is greedy
    assert run(temperature=0.7, top_p=1e-6, seed=3) == greedy  # so is a vanishing nucleus


def test_graph_replay_equals_eager_steps(tiny_q_dir, device):
    """CUDA: the captured graph decodes the same tokens as the same steps run eagerly (both
    uncompiled: inductor's fused kernels round differently, and a sampled token may then differ)."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    model, _ = load_model(tiny_q_dir, device, tokenizer=False)
    prompts = prompts_of(model, (2, 13, 5), seed=4)
    opts = SamplingOptions(temperature=0.9, top_p=0.9, seed=1)
    graphed = Decoder(model, compile=False).generate_ids(prompts, 40, opts, stop_at_eos=False)
    eager = Decoder(model, graphs=False).generate_ids(prompts, 40, opts, stop_at_eos=False)
    assert graphed.graphs and not eager.graphs
    assert graphed.tokens == eager.tokens


def test_bad_requests(tiny_llama_dir):
    from qpalette.errors import InputError

    model, _ = load_model(tiny_llama_dir, "cpu", tokenizer=False)
    dec = Decoder(model)
    for prompts, n, msg in (([[]], 4, "at least one token"), ([[1]], 0, "≥ 1"),
                            ([[1] * 500], 20, "exceed the model's 512 positions"),
                            ([[1]] * 129, 4, "at most 128")):
        with pytest.raises(InputError, match=msg):
            dec.generate_ids(prompts, n, GREEDY)
    with pytest.raises(InputError, match="temperature"):
        SamplingOptions(temperature=-1)


@pytest.mark.gpu
def test_smollm2_greedy_equals_transformers_on_the_gpu(smollm2_dir):
    """The real model in float16 with CUDA graphs: greedy under teacher forcing, and transformers'
    generate gives the same tokens up to float16 near-ties."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    model, tok = load_model(smollm2_dir, "cuda")
    dec = Decoder(model)
    same = 0
    for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"):
        ids = tok(text)["input_ids"]
        mine = dec.generate_ids([ids], 48, GREEDY, stop_at_eos=False)
        assert mine.graphs
        assert_greedy(model, ids, mine.tokens[0], tol=0.05)
        theirs = hf_greedy(model, ids, 48)
        same += next((i for i, (a, b) in enumerate(zip(mine.tokens[0], theirs)) if a != b), 48)
    assert same >= 3 * 16  # float16 near-ties aside, the sequences agree (one parted at token 29)
