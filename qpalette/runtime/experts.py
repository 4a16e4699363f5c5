"""MoE experts on the kernels: the routed experts of a decode step in one launch per palette entry.

models/experts.py runs the tokens through their experts one expert at a time: a kernel launch per
expert and projection, and `top_k_index.unique().tolist()` brings the router's choice back to the
host, which also stops CUDA-graph capture. `QuantizedExperts` (what a compressed checkpoint's
experts become) instead treats every (token, choice) pair of up to 8 tokens as a slot: one
`qpalette::expert_matmul` launch per entry computes gate and up of all slots — the GEMV reads each
slot's expert from the router's output on the GPU and that expert's tensors through a table of
device addresses built once — and one more computes down; the slots are then summed with the
router's weights. A plan that gives the experts several entries costs a launch per entry. Other
calls (CPU, more tokens, gradients, layers that are not plain quantized ones) take the per-expert
path, and so does every call under `QPALETTE_GROUPED_EXPERTS=0` (for A/B measurements).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from qpalette.models.experts import PerExpertMLP
from qpalette.runtime import ops
from qpalette.runtime.modules import FusedSlice, QuantizedLinear

MAX_TOKENS = ops.FUSED_MAX_ROWS  # tokens a grouped call takes (decode batches)
IN_ROLES = ("gate_proj", "up_proj")  # read the token's hidden state
OUT_ROLES = ("down_proj",)


@dataclass
class Launch:
    """One expert_matmul launch: the (role, expert) matrices quantized with one entry."""

    quantizer: str
    rows: int
    member_of: torch.Tensor  # (roles · experts + 1,) int64: index into `members`, or −1 (the last: no expert)
    members: list[tuple]     # (codes, codes_b, row_scale, signs) runtime tensors of each member
    table: torch.Tensor      # (members, 4) int64: their device addresses, for the kernel

    def __call__(self, x: torch.Tensor, x_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        members = self.member_of[keys]
        if x.is_cuda:
            ops.prepare(x, self.quantizer)  # eager calls only: the table and H_K before any capture
            ops.prepare(x)
            codes, codes_b, row_scale, signs = self.members[0]
            return ops.expert_matmul(x, x_rows, members, self.table, codes, codes_b, row_scale, signs,
                                     self.quantizer, self.rows)
        return ops.expert_matmul_reference(x, x_rows, members, self.members, self.quantizer, self.rows)


def _matrix(layer) -> tuple[str, tuple] | None:
    """(entry, runtime tensors) of one expert projection, rows sliced out of a fused group, or
    None when the layer is not a plain quantized one (a LoRA wrapper, a bias, unaligned rows, no
    rotation)."""
    if isinstance(layer, FusedSlice):
        group, start, stop = layer.group, layer.start, layer.stop
    elif isinstance(layer, QuantizedLinear):
        group, start, stop = layer, 0, layer.out_features
    else:
        return None
    if group.bias is not None or group.rotation is None or start % 16 or stop % 16:
        return None
    group.to_lane_major()
    tensors = group.stored_tensors()
    codes, codes_b = ops.code_tensors(group.quantizer.name, tensors)
    tiles = slice(start // 16, stop // 16)
    return group.quantizer.name, (codes[tiles], codes_b[tiles] if codes_b is not None else None,
                                  tensors["row_scale"][start:stop], group.rotation.signs)


def launches(experts: PerExpertMLP, roles: tuple[str, ...]) -> list[Launch] | None:
    """The launches covering `roles` of every expert (key r·E + e; key roles·E: none), one per
    entry, or None."""
    n = len(experts)
    found: dict[str, list[tuple]] = {}
    member_of: dict[str, list[int]] = {}
    for r, role in enumerate(roles):
        for e, expert in enumerate(experts):
            m = _matrix(getattr(expert, role, None))
            if m is None:
                return None
            entry, tensors = m
            if not ops.gemv_rotates_entry(entry, tensors[3].numel() * 8):
                return None
            members = found.setdefault(entry, [])
            member_of.setdefault(entry, [-1] * (len(roles) * n + 1))[r * n + e] = len(members)
            members.append(tensors)
    out = []
    for entry, members in found.items():
        device = members[0][0].device
        rows = members[0][2].numel()
        if any(t[2].numel() != rows for t in members):
            return None
        addresses = [[c.data_ptr(), b.data_ptr() if b is not None else 0, s.data_ptr(), g.data_ptr()]
                     for c, b, s, g in members]
        out.append(Launch(entry, rows, torch.tensor(member_of[entry], dtype=torch.int64, device=device),
                          members, torch.tensor(addresses, dtype=torch.int64, device=device)))
    return out


_OWNER = "_qpalette_grouped_owner"  # on each expert: a weak reference to its QuantizedExperts


def _forget_plan(module, name, submodule):
    """A module registered on the experts or one expert (peft wrapping a layer in a LoRA layer, say):
    that QuantizedExperts makes its plan again. A global hook, because the swap happens on the
    expert; it touches nothing else, so a registration elsewhere (a compiler building its graph
    modules) leaves the plans and the compiled forward alone."""
    owner = module if isinstance(module, QuantizedExperts) else module.__dict__.get(_OWNER, lambda: None)()
    if owner is not None:
        owner.__dict__.pop("_plan", None)


nn.modules.module.register_module_module_registration_hook(_forget_plan)


class QuantizedExperts(PerExpertMLP):
    """PerExpertMLP whose decode steps run as grouped launches (see the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self._takes(hidden_states, top_k_index):
            plan = self.__dict__["_plan"] if "_plan" in self.__dict__ else self.plan()
            if plan is not None:
                return self.grouped(hidden_states, top_k_index, top_k_weights, plan)
        return super().forward(hidden_states, top_k_index, top_k_weights)

    def _takes(self, x: torch.Tensor, top_k_index: torch.Tensor) -> bool:
        return (_grouped_on() and ops.uses_kernels(x) and top_k_index.shape[0] <= MAX_TOKENS
                and not (torch.is_grad_enabled() and x.requires_grad)
                and all(ops.fuses_rotation(n, 1) for n in (x.shape[-1], self[0].down_proj.in_features)))

    @torch.compiler.disable  # built eagerly, before any graph captures the forward
    def plan(self) -> tuple[list[Launch], list[Launch]] | None:
        """(gate/up launches, down launches), or None when the experts cannot run grouped; kept
        until a layer under the experts is replaced or the experts move."""
        if "_plan" not in self.__dict__:
            for expert in self:
                expert.__dict__[_OWNER] = weakref.ref(self)
            ins, outs = launches(self, IN_ROLES), launches(self, OUT_ROLES)
            self.__dict__["_plan"] = (ins, outs) if ins and outs else None
        return self.__dict__["_plan"]

    def grouped(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                plan: tuple[list[Launch], list[Launch]]) -> torch.Tensor:
        """Every slot through its expert, as the grouped launches compute it (any device: on CPU
        the launches run the reference)."""
        tokens, k = top_k_index.shape
        n, slots = len(self), tokens * k
        flat = top_k_index.reshape(-1).long()
        valid = (flat >= 0) & (flat < n)  # other indices (a masked choice) add nothing, as per expert
        slot = torch.arange(slots, device=flat.device)
        ins, outs = plan
        keys = torch.cat([torch.where(valid, flat + r * n, len(IN_ROLES) * n) for r in range(len(IN_ROLES))])
        h = _summed(ins, hidden_states, (slot // k).repeat(len(IN_ROLES)), keys)
        act = self[0].act_fn(h[:slots]) * h[slots:]
        y = _summed(outs, act, slot, torch.where(valid, flat, len(OUT_ROLES) * n))
        y = (y * top_k_weights.reshape(slots, 1)).to(hidden_states.dtype)
        return y.view(tokens, k, -1).sum(dim=1)

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_plan", None)  # moved or cast: the addresses change
        return super()._apply(fn, recurse)


@torch.compiler.assume_constant_result
def _grouped_on() -> bool:
    return os.environ.get("QPALETTE_GROUPED_EXPERTS", "1") != "0"


def _summed(plan: list[Launch], x: torch.Tensor, x_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Σ of the launches' outputs: each fills its members' slots and leaves zeros elsewhere."""
    out = None
    for launch in plan:
        y = launch(x, x_rows, keys)
        out = y if out is None else out + y
    return out


def install(model: nn.Module) -> None:
    """Every PerExpertMLP of `model` runs grouped when it can (in place; state unchanged)."""
    for m in model.modules():
        if type(m) is PerExpertMLP:
            m.__class__ = QuantizedExperts


def uninstall(model: nn.Module) -> None:
    """Back to the per-expert path (the layers are about to stop being quantized ones)."""
    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            m.__dict__.pop("_plan", None)
            m.__class__ = PerExpertMLP
