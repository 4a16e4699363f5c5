"""Quality of a (compressed or original) causal LM: perplexity and data-free KL divergence.

Perplexity follows the usual GPTQ protocol: the whole evaluation text is tokenized once (the
text of `qpalette.calibration.data.load_text`: a `datasets` split, WikiText-2 test by default,
joined with "\\n\\n", or a local text file as is), cut into floor(N / ctx) non-overlapping
windows of `ctx` tokens (the tail is dropped), every window is scored on its own (no context
carried over), and ppl = exp(mean next-token NLL over all predicted tokens, ctx − 1 per window).

KL divergence (`kl_to_reference`) needs no data: `num_seqs` sequences of `seq_len` tokens are
sampled from the *reference* model (`qpalette.calibration.data.sample_model`: BOS, then
temperature-1 samples, seeded), and the mean per-token KL(p_ref ‖ p_model) of the next-token
distributions at every position is reported in nats per token (the loss `qpalette calibrate`
fits its sensitivities to).

Models are loaded through `qpalette.models.load_model`, so anything `resolve_model` accepts works,
compressed qpalette checkpoints included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from qpalette.calibration.data import load_text, sample_model
from qpalette.devices import dtype_name, resolve_device, resolve_dtype
from qpalette.errors import InputError
from qpalette.progress import progress_bar

FORMAT = "qpalette.eval/1"


# --------------------------------------------------------------------------- text


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one 1-D int64 tensor (the tokenizer's own special tokens, e.g. a leading
    BOS, as in the GPTQ protocol); no 'sequence too long' warning."""
    if tokenizer is None:
        raise InputError("the model has no tokenizer; perplexity needs one")
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        ids = tokenizer(text, return_tensors=None)["input_ids"]
    finally:
        hf_logging.set_verbosity(level)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- perplexity


@dataclass
class Perplexity:
    ppl: float
    nll: float  # mean NLL per predicted token, nats
    ctx: int
    windows: int  # windows scored
    windows_total: int  # floor(text tokens / ctx)
    tokens: int  # tokens fed to the model (windows · ctx)
    predicted: int  # tokens scored (windows · (ctx − 1))
    text_tokens: int
    seconds: float
    tokens_per_s: float
    source: str = ""


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (float64) of each row of ids [b, L] under logits [b, L, V]."""
    lg = logits[:, :-1].float()
    nll = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return nll.view(ids.shape[0], -1).double().sum(dim=1)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, ctx: int = 2048, max_windows: int | None = None,
               batch_size: int = 1, device=None, progress: bool = False,
               source: str = "") -> Perplexity:
    """Perplexity of `model` over non-overlapping windows of `ctx` tokens of the 1-D `ids`."""
    if ctx < 2:
        raise InputError("--ctx must be at least 2")
    if max_windows is not None and max_windows < 1:
        raise InputError("--max-windows must be at least 1")
    if batch_size < 1:
        raise InputError("--batch-size must be at least 1")
    ids = ids.reshape(-1)
    total = ids.numel() // ctx
    if total < 1:
        raise InputError(f"the text has {ids.numel()} tokens, fewer than one window of --ctx {ctx}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and ctx > limit:
        raise InputError(f"--ctx {ctx} is longer than the model's max_position_embeddings ({limit})")
    n = min(total, max_windows) if max_windows else total
    windows = ids[: n * ctx].view(n, ctx)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    bar = progress_bar(n, "perplexity", "win", progress, smoothing=0.1)
    nll_sum = 0.0
    t0 = time.perf_counter()
    try:
        for b0 in range(0, n, batch_size):
            x = windows[b0: b0 + batch_size].to(device)
            logits = model(input_ids=x, use_cache=False).logits
            nll_sum += float(window_nll(logits, x).sum())
            del logits
            if progress:
                done = b0 + x.shape[0]
                bar.set_postfix_str(f"ppl={math.exp(nll_sum / (done * (ctx - 1))):.3f}", refresh=False)
            bar.update(x.shape[0])
    finally:
        bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    predicted = n * (ctx - 1)
    nll = nll_sum / predicted
    return Perplexity(ppl=math.exp(nll), nll=nll, ctx=ctx, windows=n, windows_total=total,
                      tokens=n * ctx, predicted=predicted, text_tokens=ids.numel(),
                      seconds=seconds, tokens_per_s=n * ctx / seconds if seconds > 0 else float("inf"),
                      source=source)


# --------------------------------------------------------------------------- KL to a reference


@dataclass
class KL:
    kl: float  # mean per-token KL(ref ‖ model), nats
    num_seqs: int
    seq_len: int
    seed: int
    tokens: int
    sampling_s: float
    seconds: float
    reference: str = ""


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits
    return F.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def mean_kl(ref_model, model, tokens: torch.Tensor, device=None, batch_tokens: int | None = None,
            progress: bool = False) -> float:
    """Mean over every position of `tokens` [n, L] of KL(p_ref ‖ p_model), nats per token."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    n, length = tokens.shape
    if batch_tokens is None:
        batch_tokens = 8192 if device.type == "cuda" else 2048
    batch = max(1, batch_tokens // length)
    bar = progress_bar(n, "KL", "seq", progress, smoothing=0.1)
    total = 0.0
    try:
        for b0 in range(0, n, batch):
            x = tokens[b0: b0 + batch].to(device)
            ref = _logprobs(ref_model, x)
            lp = _logprobs(model, x)
            if ref.shape[-1] != lp.shape[-1]:
                raise InputError(f"the reference predicts {ref.shape[-1]} token ids, the model "
                                f"{lp.shape[-1]}: KL needs the same vocabulary")
            total += float(F.kl_div(lp, ref, log_target=True, reduction="sum").double())
            del ref, lp
            bar.update(x.shape[0])
    finally:
        bar.close()
    return total / tokens.numel()


def kl_to_reference(model, ref_model, ref_tokenizer, num_seqs: int = 32, seq_len: int = 512,
                    seed: int = 0, device=None, progress: bool = False, reference: str = "") -> KL:
    """Data-free KL: sample from the reference, then mean KL(ref ‖ model) over those tokens."""
    if num_seqs < 1 or seq_len < 1:
        raise InputError("--kl-seqs and --kl-len must be at least 1")
    ref_vocab = getattr(ref_model.config, "vocab_size", None)
    vocab = getattr(model.config, "vocab_size", None)
    if ref_vocab and vocab and ref_vocab != vocab:
        raise InputError(f"the reference has {ref_vocab} token ids, the model {vocab}: KL needs the "
                        "same vocabulary (compare a model with its own original)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    t0 = time.perf_counter()
    tokens = sample_model(ref_model, ref_tokenizer, num_seqs, seq_len, seed, device, progress)
    t1 = time.perf_counter()
    kl = mean_kl(ref_model, model, tokens, device, progress=progress)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return KL(kl=kl, num_seqs=num_seqs, seq_len=seq_len, seed=seed, tokens=tokens.numel(),
              sampling_s=t1 - t0, seconds=time.perf_counter() - t0, reference=reference)


# --------------------------------------------------------------------------- the command


@dataclass
class EvalOptions:
    model: str
    dataset: str | None = None
    text_file: str | None = None
    ctx: int = 2048
    max_windows: int | None = None
    batch_size: int = 1
    kl_to: str | None = None
    kl_seqs: int = 32
    kl_len: int = 512
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    json_out: str | None = None
    progress: bool = True


def evaluate(opts: EvalOptions, log: Callable[[str], None] = print) -> dict:
    """Run the evaluation `opts` asks for; returns (and with json_out writes) the result document.

    Perplexity runs when a dataset or text file is given, or when no --kl-to is (then on the
    default dataset, wikitext2); KL runs when --kl-to is given."""
    from qpalette.fileio import atomic_write_json
    from qpalette.models.sources import resolve_model
    from qpalette.runtime.loading import load_model

    if opts.dataset and opts.text_file:
        raise InputError("give --dataset or --text-file, not both")
    if opts.ctx < 2:
        raise InputError("--ctx must be at least 2")
    if opts.max_windows is not None and opts.max_windows < 1:
        raise InputError("--max-windows must be at least 1")
    if opts.kl_seqs < 1 or opts.kl_len < 1:
        raise InputError("--kl-seqs and --kl-len must be at least 1")
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    do_ppl = bool(opts.dataset or opts.text_file or not opts.kl_to)
    t_start = time.perf_counter()

    text = source = None
    if do_ppl:  # the text first: a missing file or an offline hub fails before any model loads
        text, source = load_text(opts.text_file, opts.dataset)
    model_dir = resolve_model(opts.model)
    ref_dir = resolve_model(opts.kl_to) if opts.kl_to else None
    model, tok = load_model(model_dir, device, dtype)
    doc = {"format": FORMAT, "model": opts.model, "model_dir": str(model_dir),
           "device": str(device), "dtype": dtype_name(dtype), "perplexity": None, "kl": None}

    if do_ppl:
        ids = tokenize(tok, text)
        del text
        r = perplexity(model, ids, opts.ctx, opts.max_windows, opts.batch_size, device,
                       opts.progress, source)
        doc["perplexity"] = asdict(r)
        log(f"perplexity {r.ppl:.4f}  ({r.source}, ctx {r.ctx}, {r.windows}/{r.windows_total} windows, "
            f"{r.tokens} tokens, {r.seconds:.1f} s, {r.tokens_per_s:.0f} tok/s)")
    if ref_dir is not None:
        ref_model, ref_tok = load_model(ref_dir, device, dtype)
        k = kl_to_reference(model, ref_model, ref_tok, opts.kl_seqs, opts.kl_len, opts.seed, device,
                            opts.progress, reference=opts.kl_to)
        del ref_model
        doc["kl"] = asdict(k)
        log(f"KL(ref ‖ model) {k.kl:.6f} nats/token  (reference {k.reference}, {k.num_seqs}×{k.seq_len} "
            f"sampled tokens, seed {k.seed}, sampling {k.sampling_s:.1f} s, total {k.seconds:.1f} s)")
    doc["seconds"] = round(time.perf_counter() - t_start, 3)
    if opts.json_out:
        atomic_write_json(opts.json_out, doc)
    return doc
