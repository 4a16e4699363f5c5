"""Finding a model's quantizable layers by walking it, and their input groups by tracing it.

The model is built from its config on the meta device (no weights, no memory), MoE experts split
into one linear layer each (models/experts.py). Its decoder blocks are `model.layers` (beside
`model.embed_tokens`, `model.norm` and `lm_head`); every nn.Linear inside a block is a candidate
layer, kept when it matches a `targets` pattern and no `ignore` pattern (regular expressions
searched in the full name, like llm-compressor's targets/ignore; `DEFAULT_TARGETS`,
`DEFAULT_IGNORE`). A parameter of two or more dimensions inside a block that belongs to no linear
layer (nor to a router) is a layout qpalette does not understand: the model is refused, naming it.

Which layers read the same input is traced, not read from names: each block runs alone on the
meta device (hidden states, rotary tables and no mask as meta tensors) with a hook on every linear
layer recording the tensor object it reads. Layers of one parent module that read one tensor form
an input group: one sign vector, one online rotation (`…self_attn.rotate_qkv`), and the layers a
fused kernel may concatenate (q, k, v; gate, up). A pre-fused layer (Phi-3's `qkv_proj`) is a
group of one.

`cache_kwarg` names the keyword a model's forward takes its KV cache by, which transformers renamed.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass

import torch
from torch import nn

from qpalette.errors import ModelError
from qpalette.models.topology import (
    HEAD,
    LayerShape,
    base_model_type,
    group_key,
    kind_of,
    rotation_name,
)

#: every linear layer inside a decoder block
DEFAULT_TARGETS = (r"^model\.layers\.\d+\.",)
#: MoE routers kept as nn.Linear by some families (`mlp.gate`, Qwen2-MoE's `shared_expert_gate`):
#: a few rows that decide where tokens go stay 16-bit
DEFAULT_IGNORE = (r"\.mlp\.gate$", r"\.shared_expert_gate$", r"\.router$")
_TRACE_TOKENS = 4


def unsupported(what: str) -> ModelError:
    """The one-line refusal of a model whose layers qpalette cannot find."""
    return ModelError(f"unsupported model: {what}")


def skeleton(cfg: dict) -> nn.Module:
    """The causal LM of `cfg` on the meta device, experts split per expert."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qpalette.models.experts import unfuse_experts

    mt = base_model_type(cfg)
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "quantization_config")}
    try:
        config = AutoConfig.for_model(mt, **kwargs)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 — transformers raises many kinds for a config it cannot build
        raise unsupported(f"model_type {mt!r}: transformers cannot build a causal LM from this config "
                          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})") from None
    return unfuse_experts(model)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """`model.model.layers` of a decoder-only LM with `model.model.norm` and `lm_head`."""
    base = getattr(model, "model", None)
    blocks = getattr(base, "layers", None)
    if not isinstance(blocks, nn.ModuleList) or getattr(base, "norm", None) is None \
            or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise unsupported(f"{type(model).__name__} is not laid out as model.layers (decoder blocks), "
                          "model.norm and lm_head")
    return blocks


def cache_kwarg(model) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` where the forward names it
    (transformers 5.24 renamed it, and warns on every call given the old name), else
    `past_key_values`. Inspects the class's signature (once per class): resolve it outside code that
    torch.compile traces."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    try:
        params = inspect.signature(inspect.unwrap(cls.forward)).parameters
    except (AttributeError, TypeError, ValueError):  # no forward, or one without a signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def check_block_params(block: nn.Module, prefix: str) -> None:
    """Refuse a parameter of ≥ 2 dimensions that belongs to no linear layer and no router."""
    for mname, mod in block.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) or type(mod).__name__.endswith("Router"):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.ndim >= 2:
                full = f"{prefix}{mname + '.' if mname else ''}{pname}"
                raise unsupported(f"{full} ({type(mod).__name__}, a {p.ndim}-D parameter of shape "
                                  f"{list(p.shape)}) is not a linear layer; its block layout is not understood")


def trace_inputs(block: nn.Module, hidden: int) -> dict[str, int]:
    """Relative linear-layer name → index of the input tensor it read, running the block on meta."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [mod.register_forward_pre_hook(functools.partial(_record, seen, name))
             for name, mod in block.named_modules() if isinstance(mod, nn.Linear)]
    attn = getattr(block, "self_attn", None)
    head_dim = getattr(attn, "head_dim", None)
    try:
        if head_dim is None:
            raise unsupported(f"{type(block).__name__} has no self_attn with a head_dim; its block layout is "
                              "not understood")
        with torch.no_grad(), torch.device("meta"):
            h = torch.empty(1, _TRACE_TOKENS, hidden)
            rope = torch.empty(1, _TRACE_TOKENS, head_dim)
            block(h, attention_mask=None, position_ids=torch.arange(_TRACE_TOKENS)[None],
                  position_embeddings=(rope, rope), use_cache=False)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 — any failure means the block is not one we can trace
        raise unsupported(f"{type(block).__name__} cannot be traced ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:160]}); its block layout is not understood") from None
    finally:
        for handle in hooks:
            handle.remove()
    ids: dict[int, int] = {}
    return {name: ids.setdefault(id(x), len(ids)) for name, x in seen.items()}


def _record(seen: dict, name: str, _mod, args) -> None:
    seen.setdefault(name, args[0])


def block_layers(block: nn.Module, j: int, hidden: int) -> list[LayerShape]:
    """The linear layers of block j in module order with their traced input groups."""
    prefix = f"model.layers.{j}."
    check_block_params(block, prefix)
    inputs = trace_inputs(block, hidden)
    linears = [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    missing = [n for n, _ in linears if n not in inputs]
    if missing:
        raise unsupported(f"{prefix}{missing[0]} did not run when block {j} was traced; its block layout "
                          "is not understood")
    members: dict[tuple[str, int], list[str]] = {}  # (parent, input) → layer names
    for n, _ in linears:
        members.setdefault((n.rpartition(".")[0], inputs[n]), []).append(n)
    keys = {k: group_key([kind_of(n) for n in ns]) for k, ns in members.items()}
    count = {}
    for key in keys.values():
        count[key] = count.get(key, 0) + 1
    out = []
    for n, m in linears:
        parent = n.rpartition(".")[0]
        key = keys[(parent, inputs[n])]
        group = key if count[key] == 1 else f"{parent}.{key}"
        out.append(LayerShape(prefix + n, m.out_features, m.in_features, j, kind_of(n), group,
                              rotation_name(prefix + parent, key)))
    return out


@dataclass(frozen=True)
class Walk:
    """A model's layers (every linear layer of its blocks), lm_head, and parameter counts."""

    layers: tuple[LayerShape, ...]
    head: LayerShape
    params: tuple[tuple[str, str, int], ...]  # (name, category, numel) of every parameter outside the layers

    def select(self, targets: list[str] | None = None, ignore: list[str] | None = None) -> list[LayerShape]:
        """The layers matching a `targets` pattern and no `ignore` pattern (regular expressions)."""
        inc = _compile(targets or DEFAULT_TARGETS, "targets")
        exc = _compile(DEFAULT_IGNORE if ignore is None else ignore, "ignore")
        chosen = [l for l in self.layers if any(p.search(l.name) for p in inc)
                  and not any(p.search(l.name) for p in exc)]
        if not chosen:
            raise ModelError(f"no linear layer matches targets {list(targets or DEFAULT_TARGETS)} "
                             f"less ignore {list(DEFAULT_IGNORE if ignore is None else ignore)}")
        return chosen

    def unquantized(self, quantized: set[str]) -> dict[str, int]:
        """Parameter counts of what stays 16-bit, by category, with the layers in `quantized` quantized."""
        out: dict[str, int] = {}
        for name, category, n in self.params:
            if category in ("attention_bias", "mlp_bias") and name.rpartition(".")[0] not in quantized:
                category = "unquantized_linears"  # the bias of a linear layer left 16-bit
            out[category] = out.get(category, 0) + n
        unquantized_weights = sum(l.numel for l in self.layers if l.name not in quantized)
        if unquantized_weights:
            out["unquantized_linears"] = out.get("unquantized_linears", 0) + unquantized_weights
        return {k: out[k] for k in _CATEGORIES if out.get(k)}


_CATEGORIES = ("embed_tokens", "lm_head", "norms", "qk_norms", "attention_bias", "mlp_bias", "routers",
               "unquantized_linears", "other")


def _compile(patterns, what: str) -> list[re.Pattern]:
    try:
        return [re.compile(p) for p in patterns]
    except re.error as e:
        raise ModelError(f"{what} pattern is not a regular expression: {e}") from None


def _category(name: str, module: nn.Module) -> str:
    """The unquantized-parameter category of one parameter (by where it lives)."""
    if name.startswith("model.embed_tokens."):
        return "embed_tokens"
    if name.startswith("lm_head."):
        return "lm_head"
    if isinstance(module, nn.Linear):
        return "attention_bias" if ".self_attn." in name else "mlp_bias"
    if type(module).__name__.endswith("Router"):
        return "routers"
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return "qk_norms"
    if "norm" in name.rpartition(".")[0].rpartition(".")[2]:
        return "norms"
    return "other"


def walk_model(model: nn.Module) -> Walk:
    """The Walk of a model skeleton (meta) or a loaded model."""
    blocks = decoder_blocks(model)
    hidden = model.config.hidden_size
    layers = [l for j, block in enumerate(blocks) for l in block_layers(block, j, hidden)]
    head = LayerShape(HEAD, model.lm_head.out_features, model.lm_head.in_features, len(blocks), "head")
    layer_weights = {f"{l.name}.weight" for l in layers} | {"lm_head.weight"}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    params = []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full in layer_weights and full != "lm_head.weight":
                continue
            if full == "lm_head.weight" and tied:
                continue
            params.append((full, _category(full, mod), p.numel()))
    return Walk(tuple(layers), head, tuple(params))


@functools.lru_cache(maxsize=16)
def _walk_json(cfg_json: str) -> Walk:
    return walk_model(skeleton(json.loads(cfg_json)))


def walk(cfg: dict) -> Walk:
    """The Walk of the model of a config.json (cached per config)."""
    return _walk_json(json.dumps(cfg, sort_keys=True, default=str))

