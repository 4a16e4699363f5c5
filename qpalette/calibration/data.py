"""Evaluation sets, shared by `qpalette calibrate` and `qpalette eval` (docs/method.md §4).

Text comes from a local file (read as is) or from `datasets`: a known name (wikitext2) or any
NAME[:CONFIG[:SPLIT]]; the rows of its text column are joined with "\\n\\n" (the GPTQ protocol).
Calibration cuts the text into windows (`text_windows`) or, data-free, samples sequences from
the model itself, starting from its BOS token (`sample_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from qpalette.errors import InputError
from qpalette.models.walk import cache_kwarg
from qpalette.progress import progress_bar

DATASETS = {
    # --dataset NAME: (datasets path, config, split)
    "wikitext2": ("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
}
DATASET_ALIASES = {"wikitext-2": "wikitext2", "wikitext": "wikitext2", "wiki2": "wikitext2"}
DEFAULT_DATASET = "wikitext2"


# --------------------------------------------------------------------------- text


def load_text(text_file: str | Path | None = None, dataset: str | None = None) -> tuple[str, str]:
    """(text, source description) from `text_file` (UTF-8, universal newlines) or `dataset`
    (a name in DATASETS or NAME[:CONFIG[:SPLIT]]; default wikitext2)."""
    if dataset and text_file:
        raise InputError("give --dataset or --text-file, not both")
    if text_file:
        return _read_text_file(Path(text_file).expanduser())
    path, config, split, label = dataset_spec(dataset or DEFAULT_DATASET)
    return _dataset_text(path, config, split, label), f"dataset:{label}"


def dataset_spec(dataset: str) -> tuple[str, str | None, str, str]:
    """(datasets path, config, split, label) of a --dataset value: a known name or alias, or
    NAME[:CONFIG[:SPLIT]] (split "test" when left out)."""
    spec = dataset.strip()
    if ":" not in spec:
        key = DATASET_ALIASES.get(spec.lower(), spec.lower())
        if key in DATASETS:
            return (*DATASETS[key], key)
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise InputError(f"--dataset '{dataset}': use {', '.join(DATASETS)} or a `datasets` "
                         "NAME[:CONFIG[:SPLIT]], e.g. wikitext:wikitext-2-raw-v1:test")
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "test"
    return parts[0], config, split, spec


def _read_text_file(p: Path) -> tuple[str, str]:
    if not p.is_file():
        raise InputError(f"--text-file {p}: no such file")
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"--text-file {p}: {e.strerror or e}") from None
    return text, f"file:{p.name}"


def _dataset_text(path: str, config: str | None, split: str, label: str) -> str:
    try:
        import datasets

        ds = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, hub errors, cache problems: all reported alike
        first = (str(e).splitlines() or [""])[0][:200]
        raise InputError(
            f"cannot load {label} ({path}, {config}, {split}) through `datasets` "
            f"({type(e).__name__}: {first}). Offline? Pass the raw text with --text-file FILE."
        ) from None
    column = "text" if "text" in ds.column_names else next(
        (c for c in ds.column_names if len(ds) and isinstance(ds[0][c], str)), None)
    if column is None:
        raise InputError(f"dataset {label} has no text column")
    return "\n\n".join(t or "" for t in ds[column])


# --------------------------------------------------------------------------- token windows


def text_windows(tokenizer, text: str, num_seqs: int, seq_len: int) -> torch.Tensor:
    """Consecutive windows of seq_len tokens from `text` (at most num_seqs of them), no special
    tokens: [n, seq_len] int64."""
    if tokenizer is None:
        raise InputError("the model has no tokenizer; data-aware calibration needs one")
    need = num_seqs * seq_len
    chars = need * 8  # tokenize only a prefix large enough (whole files can be slow to tokenize)
    while True:
        ids = tokenizer(text[:chars], return_tensors=None, add_special_tokens=False)["input_ids"]
        if len(ids) > need or chars >= len(text):
            break
        chars *= 2
    n = min(num_seqs, len(ids) // seq_len)
    if n < 1:
        raise InputError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


# --------------------------------------------------------------------------- samples of the model


def bos_token_id(tokenizer, model_config) -> int:
    """The token sampled sequences start from: the tokenizer's BOS, else the config's (the first
    of a list), else 0."""
    bos = tokenizer.bos_token_id if tokenizer is not None else None
    if bos is None:
        bos = getattr(model_config, "bos_token_id", None)
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return int(bos) if bos is not None else 0


@torch.no_grad()
def sample_tokens(model, num_seqs: int, seq_len: int, seed: int, batch: int, bos_id: int, device,
                  progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """num_seqs sequences of seq_len tokens: BOS, then samples of the model at temperature 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    cache_kw = cache_kwarg(model)  # the output field is named as the forward's keyword
    out = []
    for b0 in range(0, num_seqs, batch):
        b = min(batch, num_seqs - b0)
        ids = torch.full((b, 1), bos_id, dtype=torch.long, device=device)
        seq = [ids]
        past = None
        for _ in range(seq_len - 1):
            o = model(input_ids=ids, **{cache_kw: past}, use_cache=True)
            past = getattr(o, cache_kw)
            probs = torch.softmax(o.logits[:, -1].float(), dim=-1)
            ids = torch.multinomial(probs, 1, generator=g)
            seq.append(ids)
        out.append(torch.cat(seq, dim=1).cpu())
        if progress:
            progress(b)
        del past
    return torch.cat(out)


def sample_model(model, tokenizer, num_seqs: int, seq_len: int, seed: int, device,
                 progress: bool = False) -> torch.Tensor:
    """[num_seqs, seq_len] int64 on the CPU: `sample_tokens` from the model's BOS, in batches of
    up to 256 sequences on CUDA, 16 on the CPU."""
    device = torch.device(device)
    batch = min(num_seqs, 256 if device.type == "cuda" else 16)
    bar = progress_bar(num_seqs, "sampling", "seq", progress)
    try:
        return sample_tokens(model, num_seqs, seq_len, seed, batch, bos_token_id(tokenizer, model.config),
                             device, progress=bar.update)
    finally:
        bar.close()
