"""Text in, text out around the decoder: prompts (optionally through the tokenizer's chat
template) to token ids, new tokens back to text, streamed as they arrive."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from qpalette.errors import InputError
from qpalette.generation.decoder import Decoder, DecodeResult
from qpalette.generation.sampling import SamplingOptions

_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class Generation:
    """What `generate` returns: one text per prompt, its new token ids, and the decoder's timings."""

    texts: list[str]
    tokens: list[list[int]]
    result: DecodeResult


def decoder_for(model, graphs: bool | None = None) -> Decoder:
    """The model's decoder, kept with the model so later calls reuse its caches and graphs."""
    dec = _DECODERS.get(model)
    if dec is None or (graphs is False and dec.graphs):
        dec = _DECODERS[model] = Decoder(model, graphs)
    return dec


def encode_prompts(tokenizer, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt; with `chat`, the prompt as a user turn of the tokenizer's chat
    template, ready for the assistant's answer."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("--chat: this model's tokenizer has no chat template")
    out = []
    for p in prompts:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
        else:
            ids = tokenizer(p)["input_ids"]
        out.append(list(ids))
    return out


def stop_ids(model, tokenizer) -> tuple[tuple[int, ...], int]:
    """(end-of-sequence ids, padding id) from the generation config and the tokenizer."""
    eos: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(src, "eos_token_id", None)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, int) and t not in eos:
                eos.append(t)
    pad = getattr(tokenizer, "pad_token_id", None)
    return tuple(eos), pad if isinstance(pad, int) else (eos[0] if eos else 0)


class TextStream:
    """Incremental detokenisation of one sequence: each call returns the text its new token
    added (held back while it ends inside an unfinished UTF-8 character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown:], len(text)
        return piece

    def flush(self) -> str:
        """What is still held back once the sequence is over."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.shown = text[self.shown:], len(text)
        return piece


def generate(model, tokenizer, prompts: str | list[str], *, max_new_tokens: int = 128,
             sampling: SamplingOptions = SamplingOptions(), chat: bool = False,
             on_text: Callable[[int, str], None] | None = None, stop_at_eos: bool = True,
             graphs: bool | None = None) -> Generation:
    """Generate from each prompt. `on_text(i, piece)` is called as prompt i's text grows."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if tokenizer is None:
        raise InputError("this model has no tokenizer; generate from token ids with qpalette.generation.Decoder")
    ids = encode_prompts(tokenizer, prompts, chat)
    eos, pad = stop_ids(model, tokenizer)
    streams = [TextStream(tokenizer) for _ in prompts]

    def show(step: list[int | None]) -> None:
        for i, t in enumerate(step):
            if t is not None:
                piece = streams[i].add(t)
                if piece and on_text is not None:
                    on_text(i, piece)

    result = decoder_for(model, graphs).generate_ids(ids, max_new_tokens, sampling, eos, pad, show, stop_at_eos)
    for i, stream in enumerate(streams):
        rest = stream.flush()
        if rest and on_text is not None:
            on_text(i, rest)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return Generation(texts, result.tokens, result)
