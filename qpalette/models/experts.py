"""Mixture-of-experts blocks as one plain linear layer per expert projection.

transformers 5 keeps the experts of Mixtral, Qwen2/3-MoE and their relatives as two fused 3-D
parameters of one `…Experts` module (`gate_up_proj` [E, 2·I, H], `down_proj` [E, H, I]), while
their checkpoints store one matrix per expert. qpalette quantizes each expert on its own (its own
palette entry, sensitivity and sign vectors), so before anything walks, calibrates, converts or
loads such a model, `unfuse_experts` swaps every fused experts module for `PerExpertMLP`: a
ModuleList of experts `i` with `gate_proj`, `up_proj` and `down_proj` nn.Linear layers
(`…mlp.experts.i.gate_proj`, the names Qwen-MoE checkpoints use) and the same forward: each token
runs through the experts its router picked, weighted by the router's weights. Only the tokens
routed to an expert ever reach its layers, so noise injected into one expert measures that
expert's share of the loss, and the Hessian of its input is collected from its tokens only.

A checkpoint's per-expert tensors are read under these names (`source_name` maps Mixtral's
`block_sparse_moe.experts.i.w1/w3/w2` and its router `block_sparse_moe.gate`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

#: checkpoint names → module names: the experts and router of Mixtral-style checkpoints
_LEGACY_NAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)


#: an expert's projection (unfuse_experts names them …experts.<i>.<proj>)
_EXPERT_LAYER = re.compile(r"\.experts\.\d+\.")


def is_expert_layer(name: str) -> bool:
    """Whether the layer `name` is one routed expert's projection."""
    return _EXPERT_LAYER.search(name) is not None


def module_name(stored: str) -> str:
    """The module-tree name of a checkpoint tensor (Mixtral's per-expert names → ours)."""
    for pattern, repl in _LEGACY_NAMES:
        stored = pattern.sub(repl, stored)
    return stored


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) · up(x))."""

    def __init__(self, hidden: int, intermediate: int, act_fn, device=None, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PerExpertMLP(nn.ModuleList):
    """The experts of one MoE block, called like transformers' fused experts module:
    (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) → [T, H]."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        if hidden_states.is_meta:  # tracing the layout: every expert reads every token
            for expert in self:
                expert(hidden_states)
            return out
        for e in top_k_index.unique().tolist():
            if not 0 <= e < len(self):
                continue
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts layout: 3-D gate_up_proj and down_proj, nothing else."""
    params = dict(module.named_parameters(recurse=False))
    return (set(params) == {"gate_up_proj", "down_proj"} and params["gate_up_proj"].ndim == 3
            and params["down_proj"].ndim == 3 and hasattr(module, "act_fn")
            and not getattr(module, "is_transposed", False))


def per_expert(fused: nn.Module) -> PerExpertMLP:
    """The experts of a fused module as ExpertMLPs holding copies of its slices (on its device)."""
    gate_up, down = fused.gate_up_proj, fused.down_proj
    n, two_i, hidden = gate_up.shape
    inter = two_i // 2
    experts = PerExpertMLP(
        ExpertMLP(hidden, inter, fused.act_fn, gate_up.device, gate_up.dtype) for _ in range(n))
    if not gate_up.is_meta:
        with torch.no_grad():
            for e, expert in enumerate(experts):
                expert.gate_proj.weight.copy_(gate_up[e, :inter])
                expert.up_proj.weight.copy_(gate_up[e, inter:])
                expert.down_proj.weight.copy_(down[e])
    return experts


def unfuse_experts(model: nn.Module) -> nn.Module:
    """Replace every fused experts module of `model` by a PerExpertMLP (in place; meta or real)."""
    fused = [name for name, m in model.named_modules() if is_fused_experts(m)]
    for name in fused:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, per_expert(getattr(owner, attr)))
    return model
