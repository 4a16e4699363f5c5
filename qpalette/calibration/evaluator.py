"""The block-input cache: the loss of a perturbed model, running only the decoder blocks from the
perturbed one onward (docs/method.md §4, §8).

`BlockEvaluator.prepare()` captures every chunk's input of block 0 (and the keyword arguments the
blocks get: masks, rotary embeddings) and runs the unperturbed model once: for the reference
log-probs of the KL (kept, or the final hidden states when the log-probs do not fit
`cache_ref_bytes`), or, with loss "ce", for its mean next-token cross-entropy on the tokens
(`base_nll`).

With a plain head (logits = W·norm(h): a bias-free Linear, no soft-capping) the reference p enters
the KL of a perturbed block only through two per-token moments: with l = W·ĥ the perturbed
logits, KL(p ‖ softmax(l)) = Σ_v p_v log p_v − (pᵀW)·ĥ + logsumexp(l). `prepare` keeps those
(`ReferenceMoments`, computed in full float32 once), so an evaluation is one head matmul and one
logsumexp instead of two heads and four vocabulary-wide float32 passes (a third of calibrate's
time on a Llama-3.1-8B: results/pipeline_8b). The head's own evaluations (W perturbed) take the
general formula against a saved copy of the original W. `advance_to(j)` moves the cached inputs forward, unperturbed, to the input of block
j; `mean_kl()` / `mean_nll()` then run blocks j.. of the current (perturbed) model only.

The blocks may sit on different devices (a model split over several GPUs by accelerate,
`calibration.placement`): every block gets its cached input and keyword arguments (masks, rotary
tables) on its own device, the final norm and lm_head theirs.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from qpalette.devices import tf32_matmuls
from qpalette.errors import CalibrationError


def decoder_blocks(model):
    """model.model.layers of a decoder-only LM (Llama/Mistral/Qwen-style)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or getattr(model, "lm_head", None) is None or getattr(base, "norm", None) is None:
        raise CalibrationError(
            f"{type(model).__name__}: expected a decoder-only LM with model.layers, model.norm and "
            "lm_head (Llama/Mistral/Qwen-style)"
        )
    return layers


def linear_layers(model, targets: list[str] | None = None, ignore: list[str] | None = None
                  ) -> list[tuple[str, torch.nn.Linear, int]]:
    """(full name, module, block index) of every quantizable layer inside the decoder blocks, in
    order (models/walk.py: `targets`/`ignore` select them), then lm_head (block index: one past
    the last block, where only the head runs). MoE experts must be split (load_model does it)."""
    from qpalette.models.topology import HEAD
    from qpalette.models.topology import linear_layers as model_layers

    blocks = decoder_blocks(model)
    out = [(l.name, model.get_submodule(l.name), l.block)
           for l in model_layers(model.config.to_dict(), targets=targets, ignore=ignore)]
    if isinstance(model.lm_head, torch.nn.Linear):
        out.append((HEAD, model.lm_head, len(blocks)))
    return out


def module_device(module: torch.nn.Module, default=None) -> torch.device | None:
    """Where `module` runs: accelerate's execution device when it is dispatched, else the device of
    its first parameter (or buffer); `default` for a module holding neither."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(f"cuda:{hook_device}" if isinstance(hook_device, int) else hook_device)
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None if default is None else torch.device(default)


def to_device(obj, device: torch.device):
    """`obj` (tensors, possibly in tuples, lists and dicts) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def ref_cache_budget(device: torch.device) -> int:
    """Bytes the reference log-probs may take: 35% of the free GPU memory, 1 GiB on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.35)
    return 1 << 30


class _Stop(Exception):
    """Raised by the capture hook to stop the forward pass at block 0."""


def block_output(out):
    """A decoder block's output hidden states (older transformers return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def block_input(model, ids):
    """(input of block 0, each block's keyword arguments without the KV cache) for one batch of
    token ids: the model runs with every block swapped for a recorder of its arguments, so no block
    weight is read (they may be on the meta device). Blocks may get different arguments (Gemma's
    sliding-window and global layers: their masks and rotary tables)."""
    blocks = decoder_blocks(model)
    box: dict = {"kw": []}

    def recorder(j, hidden_states, *args, **kwargs):
        if j == 0:
            box["h"] = hidden_states
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)  # its name from transformers 5.24
        box["kw"].append({**kwargs, "use_cache": False})
        if j == len(blocks) - 1:
            raise _Stop
        return hidden_states

    hooked = [blk.__dict__.get("forward") for blk in blocks]  # accelerate's wrappers, when dispatched
    for j, blk in enumerate(blocks):
        blk.forward = functools.partial(recorder, j)
    try:
        model.model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for blk, forward in zip(blocks, hooked):
            if forward is None:
                del blk.forward
            else:
                blk.forward = forward
    return box["h"], box["kw"]


def final_norm(model, h: torch.Tensor) -> torch.Tensor:
    """The final norm of the last block's output, on the norm's device."""
    norm = model.model.norm
    return norm(h.to(module_device(norm, h.device)))


def final_logits(model, h: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """lm_head of the final norm of the last block's output, soft-capped where the model caps its
    logits (Gemma-2's final_logit_softcapping); `h` is moved to the norm's device, the normed
    states to the head's. `head_weight` replaces a Linear head's weight (its saved original)."""
    h = final_norm(model, h)
    h = h.to(module_device(model.lm_head, h.device))
    logits = model.lm_head(h) if head_weight is None else F.linear(h, head_weight, model.lm_head.bias)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def plain_head_weight(model) -> torch.Tensor | None:
    """The lm_head weight W when the logits are exactly W·norm(h) (a bias-free nn.Linear, no
    soft-capping), else None."""
    head = model.lm_head
    if type(head) is torch.nn.Linear and head.bias is None and not getattr(model.config, "final_logit_softcapping", None):
        return head.weight
    return None


class ReferenceMoments:
    """Per chunk of tokens, what the KL needs of the reference distribution p under a plain head:
    `neg_entropy` Σ_v p_v log p_v (tokens,) and `mean_row` pᵀW (tokens, hidden), float32 (float64
    for a float64 model), from an exact-product copy of W."""

    def __init__(self, weight: torch.Tensor):
        self.dtype = torch.promote_types(weight.dtype, torch.float32)
        self.weight = weight.detach().to(self.dtype, copy=True)  # the original, while the head is perturbed
        # bfloat16/float16 values are exact in TF32, so its products are exact there: fast and as
        # precise as float32 (accumulation is float32 either way); float32 models keep the
        # process's own setting (the user's --dtype)
        self.tf32_exact = weight.dtype in (torch.bfloat16, torch.float16)
        self.neg_entropy: list[torch.Tensor] = []
        self.mean_row: list[torch.Tensor] = []
        self.baseline: list[torch.Tensor] = []  # the per-token value at the reference: rounding only

    def logits(self, normed: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """W·ĥ for the normed final states (tokens, hidden), in self.dtype; `weight`: the head's
        current (perturbed) weight instead of the original."""
        x = normed.to(self.weight.device, self.dtype)
        w = self.weight if weight is None else weight.to(self.dtype)
        with tf32_matmuls(True) if x.is_cuda and self.tf32_exact else nullcontext():
            return x @ w.T

    def add_reference(self, normed: torch.Tensor) -> None:
        x = normed.to(self.weight.device, self.dtype)
        logits = self.logits(x)
        lse = torch.logsumexp(logits, dim=-1)  # as kl_sum will compute it: the baseline is bit-exact
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        p = logp.exp()
        self.neg_entropy.append((p * logp).sum(-1))
        del logp
        with tf32_matmuls(False):  # pᵀW once, in full float32
            self.mean_row.append(p @ self.weight)
        i = len(self.baseline)
        self.baseline.append(self._token_kl(i, x, lse))

    def head_kl_sum(self, normed: torch.Tensor, weight: torch.Tensor) -> float:
        """Σ over the tokens of KL(p ‖ softmax(W'·ĥ)) for a perturbed head W' (ĥ unperturbed): the
        general formula, the reference from the saved original W."""
        ref = torch.log_softmax(self.logits(normed), dim=-1)
        lq = torch.log_softmax(self.logits(normed, weight), dim=-1)
        return float(F.kl_div(lq, ref, log_target=True, reduction="sum").double())

    def _token_kl(self, i: int, x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Per-token Σ p log p − (pᵀW)·ĥ + logsumexp(W·ĥ) of chunk i; x: ĥ in self.dtype, lse: the
        logsumexp of its logits."""
        return self.neg_entropy[i] - (self.mean_row[i] * x).sum(-1) + lse

    def kl_sum(self, i: int, normed: torch.Tensor) -> float:
        """Σ over chunk i's tokens of KL(p ‖ softmax(W·ĥ)), less the same expression's value at the
        reference (its float rounding, ~1e-7): an unchanged output gives exactly 0."""
        x = normed.to(self.weight.device, self.dtype)
        lse = torch.logsumexp(self.logits(x), dim=-1)
        return float((self._token_kl(i, x, lse) - self.baseline[i]).sum().double())


class BlockEvaluator:
    """Mean KL(p_ref ‖ p_perturbed) over a fixed token set, running only blocks j.. onward."""

    def __init__(self, model, tokens: torch.Tensor, batch_size: int, device, cache_ref_bytes: int):
        self.model = model
        self.blocks = decoder_blocks(model)
        self.head = model.lm_head
        self.device = torch.device(device)  # of modules that hold no tensor (their inputs stay put)
        self.input_device = module_device(model.get_input_embeddings(), self.device)
        self.block_devices = [module_device(b, self.device) for b in self.blocks]
        self.chunks = [tokens[i: i + batch_size] for i in range(0, tokens.shape[0], batch_size)]
        self.n_tokens = tokens.numel()
        self.kwargs = {}  # each block's keyword arguments, by chunk size
        self.hidden = []  # input of block `self.block` for each chunk
        self.block = 0
        self.final = []  # unperturbed final hidden states, when the reference log-probs do not fit
        self.ref_lp = None
        self.moments = None  # ReferenceMoments under a plain head
        self._head_ref = None  # the head's original weight, when the references are recomputed
        self.base_nll = None  # mean next-token CE of the model as prepared (loss "ce")
        self._cache_ref_bytes = cache_ref_bytes

    @torch.no_grad()
    def prepare(self, loss: str = "kl") -> None:
        """Embeddings + per-shape block kwargs, then one unperturbed pass for the references of
        `loss`: "kl" (reference log-probs) or "ce" (`base_nll`)."""
        for chunk in self.chunks:
            h, kw = block_input(self.model, chunk.to(self.input_device))
            self.hidden.append(h.to(self.block_devices[0]))
            if chunk.shape[0] not in self.kwargs:
                self.kwargs[chunk.shape[0]] = [to_device(k, d) for k, d in zip(kw, self.block_devices)]
        if loss == "ce":
            self.base_nll = self.mean_nll()
            return
        self.final = [self._run_blocks(0, h) for h in self.hidden]
        weight = plain_head_weight(self.model)
        if weight is not None:
            self.moments = ReferenceMoments(weight)
            for h in self.final:
                self.moments.add_reference(self._normed(h))
            self.final = None
            return
        if self.n_tokens * self.head.out_features * 4 <= self._cache_ref_bytes:
            self.ref_lp = [self._logprobs(h) for h in self.final]
            self.final = None
        elif isinstance(self.head, torch.nn.Linear):  # the references are recomputed: keep the head's original
            self._head_ref = self.head.weight.detach().clone()

    def _run_blocks(self, start: int, h):
        kw = self.kwargs[h.shape[0]]
        for j in range(start, len(self.blocks)):
            h = block_output(self.blocks[j](h.to(self.block_devices[j]), **kw[j]))
        return h

    def _normed(self, h) -> torch.Tensor:
        """The final norm of a last-block output, flattened to (tokens, hidden)."""
        return final_norm(self.model, h).flatten(0, -2)

    def _logprobs(self, h, head_weight: torch.Tensor | None = None):
        logits = final_logits(self.model, h, head_weight)
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return F.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def advance_to(self, block: int) -> None:
        """Move the cached block inputs forward (unperturbed) to the input of `block`."""
        if block < self.block:
            raise ValueError("the block cache only moves forward")
        while self.block < block:
            j = self.block
            self.hidden = [block_output(self.blocks[j](h, **self.kwargs[h.shape[0]][j])) for h in self.hidden]
            self.block += 1
            if self.block < len(self.blocks):
                self.hidden = [h.to(self.block_devices[self.block]) for h in self.hidden]

    @torch.no_grad()
    def mean_kl(self) -> float:
        """Mean per-token KL of the current model (perturbed in block ≥ self.block) from the reference."""
        total = 0.0
        if self.moments is not None:
            for i, h in enumerate(self.hidden):
                if self.block < len(self.blocks):
                    total += self.moments.kl_sum(i, self._normed(self._run_blocks(self.block, h)))
                else:  # the head itself is perturbed; the cached inputs are the final states
                    total += self.moments.head_kl_sum(self._normed(h), self.head.weight)
            return total / self.n_tokens
        for i, h in enumerate(self.hidden):
            lp = self._logprobs(self._run_blocks(self.block, h))
            ref = self.ref_lp[i] if self.ref_lp is not None else self._logprobs(self.final[i], self._head_ref)
            total += float(F.kl_div(lp, ref, log_target=True, reduction="sum").double())
            del lp, ref
        return total / self.n_tokens

    @torch.no_grad()
    def mean_nll(self) -> float:
        """Mean next-token cross-entropy (nats per predicted token) of the current model on the
        tokens: the calibration loss of the data-aware protocols (docs/method.md §4, §8)."""
        total, count = 0.0, 0
        for chunk, h in zip(self.chunks, self.hidden):
            logits = final_logits(self.model, self._run_blocks(self.block, h))[:, :-1]
            target = chunk[:, 1:].to(logits.device)
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           reduction="sum").double())
            count += target.numel()
            del logits
        return total / count
