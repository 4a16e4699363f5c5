"""What a compressed checkpoint contains, and how a model skeleton is converted to hold it.

The `quantization_config` of config.json (`qpalette.checkpoint/1`, docs/format.md) names each
quantized layer's palette entry, the fused groups and the sign seed; everything else about
the module tree follows from it and the architecture:

- a layer alone: `…q_proj` is a `QuantizedLinear` with `codes`/`row_scale` (+ `bias`);
- a fused group: `…self_attn.qkv_proj` holds the row-concatenated tensors, `q_proj` etc. are
  `FusedSlice`s without tensors;
- one `InputRotation` per input group of a block: `…self_attn.rotate_qkv.signs`,
  `rotate_o`, `mlp.rotate_gate_up`, `rotate_down`; a quantized `lm_head` has `rotate_lm_head`;
- the used codebooks once, fp16: `qpalette_codebooks.tcq_q9`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

from qpalette.errors import CheckpointError
from qpalette.models.experts import unfuse_experts
from qpalette.models.topology import (
    GROUP_MODULES,
    HEAD,
    INPUT_GROUP_ORDER,
    group_key,
    group_module,
    kind_of,
    rotation_modules,
)
from qpalette.quant.incoherence import unpack_signs, unrotate_weight
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import experts as grouped_experts
from qpalette.runtime.modules import (
    Codebooks,
    FusedSlice,
    InputRotation,
    QuantizedLinear,
    install_cache_reset,
    install_fused_block,
    install_gated_mlp,
    remove_cache_reset,
    remove_fused_block,
    remove_gated_mlp,
)
from qpalette.version import __version__

FORMAT = "qpalette.checkpoint/1"
QUANT_METHOD = "qpalette"
CODEBOOKS_MODULE = "qpalette_codebooks"


def parent_and_attr(name: str) -> tuple[str, str]:
    parent, _, attr = name.rpartition(".")
    return parent, attr


def sign_seed(base: int, block: int, input_group: str) -> int:
    """Seed of one block's sign vector for one input group (docs/format.md): the Llama groups by
    their place in INPUT_GROUP_ORDER; any other group (an expert's, a pre-fused layer's) by a hash
    of its name."""
    if input_group in INPUT_GROUP_ORDER:
        return base * 1_000_003 + 8 * block + INPUT_GROUP_ORDER.index(input_group)
    digest = hashlib.sha256(f"{base}:{block}:{input_group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**62)


@dataclass
class Layout:
    """Per-layer quantizers, fused groups (member names in row order) and the sign seed."""

    layers: dict[str, str]
    groups: dict[str, list[str]] = field(default_factory=dict)
    sign_seed: int = 0

    def __post_init__(self):
        self.layers = {n: get_quantizer(q).name for n, q in self.layers.items()}
        grouped: set[str] = set()
        for gname, members in self.groups.items():
            kinds = [kind_of(m) for m in members]
            if len(members) < 2 or group_key(kinds) not in GROUP_MODULES:
                raise CheckpointError(f"fused group {gname}: {members} is not a fusable group")
            expect = group_module(members[0], kinds)
            if gname != expect or len({parent_and_attr(m)[0] for m in members}) != 1:
                raise CheckpointError(f"fused group {gname}: members {members} (expected {expect})")
            if len({self.layers.get(m) for m in members}) != 1 or members[0] not in self.layers:
                raise CheckpointError(f"fused group {gname}: members must share one quantizer")
            if grouped & set(members):
                raise CheckpointError(f"fused group {gname}: a layer is in two groups")
            grouped |= set(members)

    @property
    def codebooks(self) -> list[str]:
        return sorted({c for q in self.layers.values() for c in get_quantizer(q).codebooks})

    def group_of(self, layer: str) -> str | None:
        return next((g for g, ms in self.groups.items() if layer in ms), None)

    def to_config(self, extra: dict | None = None) -> dict:
        return {
            "quant_method": QUANT_METHOD,
            "format": FORMAT,
            "qpalette_version": __version__,
            "sign_seed": self.sign_seed,
            "layers": dict(self.layers),
            "groups": {g: list(ms) for g, ms in self.groups.items()},
            "codebooks": self.codebooks,
            **(extra or {}),
        }

    @classmethod
    def from_config(cls, qc: dict) -> "Layout":
        if qc.get("format") != FORMAT:
            raise CheckpointError(
                f"quantization_config format {qc.get('format')!r} is not {FORMAT!r}: written by "
                f"another qpalette version (this is {__version__})"
            )
        try:
            return cls(dict(qc["layers"]), {g: list(m) for g, m in qc.get("groups", {}).items()},
                       int(qc.get("sign_seed", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"quantization_config is malformed: {e}") from None


def _get(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(f"the model has no module {name!r} named in quantization_config") from None


def convert_model(model: nn.Module, layout: Layout, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every planned nn.Linear by qpalette modules (in place; works on the meta device),
    MoE experts split per expert first (models/experts.py).

    `dtype` is the dtype of biases (the model's dtype)."""
    unfuse_experts(model)
    linears: dict[str, nn.Linear] = {}
    for name in layout.layers:
        mod = _get(model, name)
        if not isinstance(mod, nn.Linear):
            raise CheckpointError(f"{name} is a {type(mod).__name__}, not a linear layer")
        linears[name] = mod
    dtype = dtype or next(iter(linears.values())).weight.dtype
    rotations: dict[str, InputRotation] = {}
    parents: set[str] = set()
    rotation_of = rotation_modules(model.config.to_dict())

    def rotation_for(layer: str) -> InputRotation:
        rname = rotation_of[layer]
        if rname not in rotations:
            rotations[rname] = InputRotation(linears[layer].in_features, cached=layer != HEAD)
            parent, attr = parent_and_attr(rname)
            _get(model, parent).register_module(attr, rotations[rname])
        return rotations[rname]

    for gname, members in layout.groups.items():
        outs = [linears[m].out_features for m in members]
        group = QuantizedLinear(linears[members[0]].in_features, sum(outs),
                                layout.layers[members[0]],
                                bias=linears[members[0]].bias is not None, dtype=dtype)
        group.rotation = rotation_for(members[0])
        parent, attr = parent_and_attr(gname)
        _get(model, parent).register_module(attr, group)
        start = 0
        for m, n in zip(members, outs):
            _get(model, parent).register_module(parent_and_attr(m)[1], FusedSlice(group, start, start + n))
            start += n
        parents.add(parent)
    for name, lin in linears.items():
        if layout.group_of(name):
            continue
        q = QuantizedLinear(lin.in_features, lin.out_features, layout.layers[name],
                            bias=lin.bias is not None, dtype=dtype)
        q.rotation = rotation_for(name)
        parent, attr = parent_and_attr(name)
        _get(model, parent).register_module(attr, q)
        if name != HEAD:  # lm_head's parent is the model: nothing of it is cached
            parents.add(parent)
    for parent in parents:
        install_cache_reset(_get(model, parent))
        install_gated_mlp(_get(model, parent))
    for block in {p.rpartition(".")[0] for p in parents if "." in p}:  # decoder layers: model.layers.i
        install_fused_block(_get(model, block))
    grouped_experts.install(model)
    model.register_module(CODEBOOKS_MODULE, Codebooks(layout.codebooks))
    return model


def simulated_weights(model: nn.Module, layout: Layout) -> dict[str, torch.Tensor]:
    """Layer name → W = unrotate(decode(codes) ⊙ row_scale) (float32): what the quantized model
    computes, expressed as ordinary weights of the original architecture."""
    out, decoded = {}, {}
    for name in layout.layers:
        gname = layout.group_of(name)
        mod = _get(model, gname or name)
        if (gname or name) not in decoded:  # a fused group is decoded once for all its members
            decoded[gname or name] = mod.rotated_weight()
        w_r = decoded[gname or name]
        if gname:
            sl = _get(model, name)
            w_r = w_r[sl.start : sl.stop]
        out[name] = unrotate_weight(w_r, unpack_signs(mod.rotation.signs))
    return out


def dequantize_model(model: nn.Module, layout: Layout, dtype: torch.dtype) -> nn.Module:
    """Back to plain nn.Linear layers holding the simulated weights (in place)."""
    weights = simulated_weights(model, layout)
    grouped_experts.uninstall(model)
    for name, w in weights.items():
        gname = layout.group_of(name)
        src = _get(model, gname or name)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=src.bias is not None, device=w.device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if src.bias is not None:
                b = src.bias if not gname else src.bias[_get(model, name).start : _get(model, name).stop]
                lin.bias.copy_(b)
        parent, attr = parent_and_attr(name)
        _get(model, parent).register_module(attr, lin)
    rotation_of = rotation_modules(model.config.to_dict())
    for name in set(layout.groups) | {rotation_of[n] for n in layout.layers}:
        parent, attr = parent_and_attr(name)
        delattr(_get(model, parent), attr)
    for m in model.modules():
        remove_cache_reset(m)
        remove_gated_mlp(m)
        remove_fused_block(m)
    delattr(model, CODEBOOKS_MODULE)
    return model
