"""transformers' `generate` on qpalette's decoder:

    out = model.generate(ids, attention_mask=mask, max_new_tokens=128,
                         custom_generate=qpalette.generation.hf_decode)

transformers prepares the request as usual (generation config, special tokens, lengths) and
hands the decoding to `hf_decode`, which runs the CUDA-graph decoder instead of its own loop.
Why: transformers' loop synchronises with the host after every token and spends ~2 ms of host
time a step (its compiled call, logits processors, stopping criteria) that the GPU waits for:
on an H100 it decodes 8B shapes at 66–78% of what the GPU needs per token (docs/results.md).

Greedy and sampling with temperature / top-k / top-p, EOS, left padding, `min_new_tokens` equal
to `max_new_tokens` and `return_dict_in_generate` (sequences only) are served; anything else
(other logits processors or stopping criteria, scores, beams) is refused with a message rather
than silently ignored. Streamers are not: transformers does not hand them to a custom decoding
method (it only shows them the prompt); stream with `qpalette.generate(..., on_text=...)`. Sampling draws from qpalette's counter-based noise
seeded by `torch.initial_seed()`: reproducible, but not the same draws as transformers' sampler.
"""

from __future__ import annotations

import torch

from qpalette.errors import InputError
from qpalette.generation.sampling import SamplingOptions

_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_MIN_LENGTH = {"MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"}
_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}
_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def hf_decode(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
              generation_config=None, synced_gpus: bool = False, **model_kwargs):
    """A `custom_generate` decoding method for transformers' `generate` (see the module docstring)."""
    from qpalette.generation.text import decoder_for

    cfg = generation_config
    prompt_len = input_ids.shape[1]
    max_new = cfg.max_length - prompt_len
    min_new = max(0, (cfg.min_length or 0) - prompt_len)
    _refuse_unsupported(logits_processor, stopping_criteria, cfg, synced_gpus, min_new, max_new)
    prompts = _prompts(input_ids, model_kwargs.get("attention_mask"))
    eos, pad = _special_ids(cfg)
    result = decoder_for(model).generate_ids(prompts, max_new, _sampling(cfg), eos, pad,
                                             stop_at_eos=min_new < max_new)
    width = max(map(len, result.tokens))
    new = torch.tensor([t + [pad] * (width - len(t)) for t in result.tokens], device=input_ids.device)
    sequences = torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)
    if cfg.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _refuse_unsupported(processors, criteria, cfg, synced_gpus: bool, min_new: int, max_new: int) -> None:
    allowed = _WARPERS | (_MIN_LENGTH if min_new >= max_new else set())
    extra = sorted({type(p).__name__ for p in processors or ()} - allowed)
    extra += sorted({type(c).__name__ for c in criteria or ()} - _CRITERIA)
    extra += [name for name in _OUTPUTS if getattr(cfg, name, False)]
    if synced_gpus:
        extra.append("synced_gpus")
    if 0 < min_new < max_new:
        extra.append("min_new_tokens below max_new_tokens")
    if getattr(cfg, "num_beams", 1) > 1:
        extra.append("num_beams")
    if extra:
        raise InputError(f"qpalette hf_decode does not implement {', '.join(extra)}; call generate without "
                         "custom_generate for these")


def _prompts(input_ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens without its left padding."""
    if mask is None:
        return input_ids.tolist()
    mask = mask.bool()
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise InputError("qpalette hf_decode needs left padding (tokenizer.padding_side = 'left')")
    return [row[m].tolist() for row, m in zip(input_ids, mask)]


def _special_ids(cfg) -> tuple[tuple[int, ...], int]:
    eos = cfg.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = cfg.pad_token_id
    return tuple(int(t) for t in eos), int(pad) if pad is not None else (int(eos[0]) if eos else 0)


def _sampling(cfg) -> SamplingOptions:
    if not cfg.do_sample:
        return SamplingOptions()
    return SamplingOptions(temperature=cfg.temperature or 1.0, top_k=cfg.top_k or 0, top_p=cfg.top_p or 1.0,
                           seed=torch.initial_seed())
