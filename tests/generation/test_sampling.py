"""The device-side token choice: hash noise, filters, Gumbel-max sampling."""

import pytest
import torch

from qpalette.generation.sampling import (
    ARGMAX_CHUNK,
    SamplingOptions,
    argmax_last,
    filtered_logits,
    next_tokens,
    noise_streams,
    uniform_noise,
)


def test_noise_is_a_pure_function_of_its_keys():
    s = noise_streams(torch.tensor(5), torch.arange(3))
    a = uniform_noise(s, torch.tensor(4), 1000)
    assert torch.equal(a, uniform_noise(s, torch.tensor(4), 1000))
    assert a.min() > 0 and a.max() < 1 and abs(a.mean().item() - 0.5) < 0.02
    assert not torch.equal(a, uniform_noise(s, torch.tensor(5), 1000))  # another step
    assert not torch.equal(a[0], a[1])  # another sequence
    assert not torch.equal(s, noise_streams(torch.tensor(6), torch.arange(3)))  # another seed


def test_samples_follow_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    opts = SamplingOptions(temperature=0.8)
    streams = noise_streams(torch.tensor(11), torch.tensor([0]))
    picks = torch.stack([next_tokens(logits, opts, streams, torch.tensor([t])) for t in range(6000)]).view(-1)
    freq = torch.bincount(picks, minlength=5).float() / len(picks)
    torch.testing.assert_close(freq, (logits[0] / 0.8).softmax(-1), atol=0.02, rtol=0)


def test_filters_keep_top_k_and_the_nucleus():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    kept = filtered_logits(logits, SamplingOptions(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [[True, False, True, False, False]]
    p = logits.softmax(-1)[0]
    nucleus = filtered_logits(logits, SamplingOptions(temperature=1.0, top_p=float(p[0] + 0.01))).isfinite()
    assert nucleus.tolist() == [[True, False, True, False, False]]  # the top token alone falls short of p
    only_top = filtered_logits(logits, SamplingOptions(temperature=1.0, top_p=1e-9)).isfinite()
    assert only_top.tolist() == [[True, False, False, False, False]]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(next_tokens(logits, SamplingOptions(), torch.zeros(4, dtype=torch.long), torch.tensor(0)),
                       logits.argmax(-1))


@pytest.mark.parametrize("vocab", [7, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK, 1000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_argmax_is_torch_argmax(vocab, dtype):
    """argmax_last against torch.argmax on fresh rows: ties (the first wins, across and inside
    chunks), NaN (counts as the maximum), all -inf, padding past a vocabulary that is no multiple
    of the chunk; eager and compiled."""
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randint(-3, 4, (6, 2, vocab), generator=gen).to(dtype)  # many ties
    rows[1, 0] = float("-inf")
    rows[2, 1, vocab // 3] = float("nan")
    rows[2, 1, vocab - 1] = float("nan")
    rows[3, 0, vocab - 1] = 100  # the maximum in the padded chunk
    rows[4] = torch.randn(2, vocab, generator=gen).to(dtype)
    expect = rows.argmax(-1)
    assert torch.equal(argmax_last(rows), expect)
    assert torch.equal(torch.compile(argmax_last, dynamic=False)(rows), expect)
