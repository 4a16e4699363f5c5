"""transformers' generate with custom_generate=qpalette.generation.hf_decode."""

import pytest
import torch

from qpalette.errors import InputError
from qpalette.generation import hf_decode
from qpalette.runtime.loading import load_model


@pytest.fixture(scope="module")
def model_and_tok(tiny_llama_dir):
    return load_model(tiny_llama_dir, "cpu")


def left_padded(tok, texts):
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_greedy_batch_equals_transformers_own_loop(model_and_tok):
    model, tok = model_and_tok
    ids, mask = left_padded(tok, ["hello there", "a", "what is it"])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    theirs = model.generate(ids, **kw)
    mine = model.generate(ids, custom_generate=hf_decode, **kw)
    assert torch.equal(mine, theirs)
    out = model.generate(ids, custom_generate=hf_decode, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, theirs)


def test_sampling_is_seeded(model_and_tok):
    model, tok = model_and_tok
    ids, mask = left_padded(tok, ["hello"])
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=True, temperature=0.9,
              top_k=30, top_p=0.9, pad_token_id=0, custom_generate=hf_decode)
    torch.manual_seed(5)
    a = model.generate(ids, **kw)
    torch.manual_seed(5)
    b = model.generate(ids, **kw)
    torch.manual_seed(6)
    c = model.generate(ids, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == (1, ids.shape[1] + 10)


def test_unsupported_requests_are_refused(model_and_tok):
    model, tok = model_and_tok
    ids, mask = left_padded(tok, ["hello"])
    for extra, what in ((dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
                        (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
                        (dict(min_new_tokens=3), "min_new_tokens")):
        with pytest.raises(InputError, match=what):
            model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, custom_generate=hf_decode,
                           **extra)
    right = torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]])
    with pytest.raises(InputError, match="left padding"):
        model.generate(right[0], attention_mask=right[1], max_new_tokens=4, pad_token_id=0,
                       custom_generate=hf_decode)
