"""The modules a compressed checkpoint loads into: rotation, quantized linear, fused-group slice.

A block's linear layers that read the same activation ({q,k,v}, {gate,up}) share one sign
vector, so one `InputRotation` per input group computes H(s ⊙ x) once and every layer of the
group reuses it. A fused group ({q,k,v} with one quantizer, say) is one `QuantizedLinear` on the
row-concatenated matrix, registered beside the layers it replaces (`self_attn.qkv_proj`); the
original names (`q_proj`, …) become `FusedSlice`s that return their rows of the group's single
matmul. Results are reused only within one call of the parent module (attention or MLP): a
forward hook on the parent drops them (`install_cache_reset`).

Buffers carry exactly the names, shapes and dtypes of the stored tensors (`Quantizer.
tensor_specs`, bit-packed `signs`), so a module built empty (on the meta device) loads a
checkpoint as it is. The first call that runs the ops (the loader's warm-up token on CUDA)
regroups the code buffers in place into the kernels' lane-major layout (runtime/lanes.py: the
same bytes, one copy); `state_dict()` and `load_state_dict()` still speak the checkpoint's
layout. fp16 buffers (row scales, codebooks) keep their dtype through `model.to(dtype)`/
`.half()`: a cast would change the stored numbers. Nothing here subclasses
`nn.Linear`: transformers re-initialises those.
"""

from __future__ import annotations

import functools
import inspect
import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from qpalette.quant.codebooks import codebook
from qpalette.quant.incoherence import pack_signs, unpack_signs, unrotate_weight
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes, ops


class _KeepsFp16(nn.Module):
    """Moves fp16 buffers between devices but never casts them (`.to(dtype)`, `.half()`)."""

    def _apply(self, fn, recurse=True):
        fp16 = [n for n, b in self._buffers.items() if b is not None and b.dtype == torch.float16]
        for n in fp16:  # an integer view is moved by .to(device) and left alone by .to(dtype)
            self._buffers[n] = self._buffers[n].view(torch.int16)
        try:
            return super()._apply(fn, recurse)
        finally:
            for n in fp16:
                self._buffers[n] = self._buffers[n].view(torch.float16)


class _CallCache:
    """One remembered (input, output) pair, valid until the parent module's call ends."""

    def _cached(self, x: torch.Tensor, compute) -> torch.Tensor:
        hit = self.__dict__.get("_cache")
        if hit is not None and hit[0] is x:
            return hit[1]
        y = compute(x)
        self.__dict__["_cache"] = (x, y)
        return y

    def reset_cache(self) -> None:
        self.__dict__["_cache"] = None

    def remember(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Take y as the result for x until the reset (computed elsewhere, e.g. with a norm fused)."""
        self.__dict__["_cache"] = (x, y)


class InputRotation(_CallCache, nn.Module):
    """H(s ⊙ x) for one input group of one block; `signs` bit-packed (in/8 bytes). `cached`: the
    result is reused within one call of the parent (which must reset it, `install_cache_reset`);
    lm_head's rotation, whose parent is the whole model, is not."""

    def __init__(self, in_features: int, cached: bool = True):
        super().__init__()
        self.in_features = in_features
        self.cached = cached
        self.register_buffer("signs", torch.zeros(in_features // 8, dtype=torch.uint8))

    def extra_repr(self) -> str:
        return f"{self.in_features}"

    @classmethod
    def from_signs(cls, signs: torch.Tensor) -> "InputRotation":
        mod = cls(signs.numel())
        mod.signs.copy_(pack_signs(signs))
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops.prepare(x)
        if not self.cached:
            return ops.rotate(x, self.signs)
        return self._cached(x, lambda t: ops.rotate(t, self.signs))


class QuantizedLinear(_CallCache, _KeepsFp16):
    """y = W_r · H(s ⊙ x) + b with W_r = decode(codes) ⊙ row_scale, via `qpalette.ops`."""

    def __init__(self, in_features: int, out_features: int, quantizer: str, bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizer = get_quantizer(quantizer)
        self.tensor_names = tuple(self.quantizer.tensor_specs(out_features, in_features))
        for name, (shape, dt) in self.quantizer.tensor_specs(out_features, in_features).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dt))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.rotation: InputRotation | None = None
        self.lane_major = False  # code buffers in the checkpoint's layout until the first op call
        self._register_state_dict_hook(_checkpoint_layout_state)

    def __setattr__(self, name, value):
        if name == "rotation":  # shared with other layers: a reference, not a child module
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return f"{self.in_features}→{self.out_features}, {self.quantizer.name}"

    @property
    def qweight(self) -> torch.Tensor:
        """The (first) code tensor: where peft and similar tools look for a quantized layer's
        device (the name GPTQ layers use)."""
        return getattr(self, self.tensor_names[0])

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers as they are now (lane-major codes once `to_lane_major` ran)."""
        return {n: getattr(self, n) for n in self.tensor_names}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers in the checkpoint's layout."""
        if not self.lane_major:
            return self.stored_tensors()
        return lanes.unpack(self.quantizer.name, self.stored_tensors(), (self.out_features, self.in_features))

    @torch.compiler.disable  # runs once, eagerly, even when the first call is a compiled one
    @torch.no_grad()
    def to_lane_major(self) -> None:
        """Regroup the code buffers into the kernels' layout (once; a no-op after)."""
        if self.lane_major:
            return
        packed = lanes.pack(self.quantizer.name, self.stored_tensors())
        for name in lanes.code_names(self.quantizer.name):
            self._buffers[name] = packed[name]
        self.lane_major = True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.lane_major:  # checkpoint-layout tensors in: regroup them like ours
            for name in lanes.code_names(self.quantizer.name):
                if prefix + name in state_dict:
                    state_dict[prefix + name] = lanes.pack_named(self.quantizer.name, name, state_dict[prefix + name])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def rotated_weight(self) -> torch.Tensor:
        """W_r = decode(codes) ⊙ row_scale in float32: the weight in the rotated domain."""
        return ops.dequantize(self.quantizer.name, self.checkpoint_tensors(),
                              (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is None:
            raise RuntimeError("QuantizedLinear has no InputRotation attached")
        w = decoded_weight(self, x)
        if w is not None:  # CPU: the weight decoded once, in the original basis (no rotation)
            y = F.linear(x, w)
        else:
            self._ready_for_ops(x)
            shape = (self.out_features, self.in_features)
            if ops.fuses_rotation(self.in_features, x.numel() // self.in_features):  # the GEMV rotates x itself
                y = ops.rotated_matmul(x, self.rotation.signs, self.quantizer.name, self.stored_tensors(), shape)
            else:  # one rotation shared by the input group
                y = ops.quantized_matmul(self.rotation(x), self.quantizer.name, self.stored_tensors(), shape)
        return self._add_bias(y)

    def _ready_for_ops(self, x: torch.Tensor) -> None:
        """Before an op call on inputs like x (in_features wide): the lane-major codes, the table and
        the rotation's H_K factor for the GEMV that rotates x itself."""
        if not self.lane_major:  # a plain attribute: compiled code guards on it, no graph break
            self.to_lane_major()
        ops.prepare(x, self.quantizer.name)
        ops.prepare(x)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def takes_gated(self, x: torch.Tensor) -> bool:
        """Whether `gated_forward` suits activations like x: the kernels' path, with the input
        formed by the GEMV (batch 1) or the rotation kernel (batch 2–8): `ops.forms_block_input`."""
        rows = x.numel() // x.shape[-1]
        return ops.uses_kernels(x) and ops.forms_block_input(self.quantizer.name, self.in_features, rows, False)

    def gated_forward(self, gu: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """forward(silu(gate) ⊙ up) [+ residual] for gu = [gate | up] (..., 2·in), the GEMV forming
        the product while it stages its input and adding the residual as it writes its output
        (`ops.gated_rotated_matmul`); callers check `takes_gated` first."""
        self._ready_for_ops(gu[..., : self.in_features])  # the gate half: the input's width and dtype
        if self.bias is not None and residual is not None:  # bias first, then the residual
            return self.gated_forward(gu) + residual
        y = ops.gated_rotated_matmul(gu, self.rotation.signs, self.quantizer.name, self.stored_tensors(),
                                     (self.out_features, self.in_features), residual)
        return self._add_bias(y)

    def takes_normed(self, x: torch.Tensor, norm: nn.Module) -> bool:
        """Whether `normed_forward` suits activations like x and this RMSNorm: the kernels' path
        (`ops.forms_block_input` with a norm: a power-of-two input) and the norm's weight in x's dtype."""
        rows = x.numel() // x.shape[-1]
        return (ops.uses_kernels(x) and ops.forms_block_input(self.quantizer.name, self.in_features, rows, True)
                and norm.weight.dtype == x.dtype)

    def normed_forward(self, x: torch.Tensor, norm: nn.Module,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(forward(norm(h)), h) with h = x + residual (or x, then None is returned for it): a
        decoder block's add + RMSNorm (`norm`: weight, variance_epsilon) in the GEMV's prologue
        (`ops.normed_rotated_matmul`); callers check `takes_normed` first."""
        self._ready_for_ops(x)
        y, h = ops.normed_rotated_matmul(x, norm.weight, norm.variance_epsilon, self.rotation.signs,
                                         self.quantizer.name, self.stored_tensors(),
                                         (self.out_features, self.in_features), residual)
        return self._add_bias(y), h

    def _apply(self, fn, recurse=True):
        forget_decoded(self)  # moved or cast: decode again where it is used next
        return super()._apply(fn, recurse)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), computed once per parent call for the slices of a fused group."""
        return self._cached(x, self.forward)


def _checkpoint_layout_state(module: "QuantizedLinear", state: dict, prefix: str, _meta) -> dict:
    """state_dict hook: lane-major code buffers go out in the checkpoint's layout."""
    if module.lane_major:
        for name, t in module.checkpoint_tensors().items():
            if prefix + name in state:
                state[prefix + name] = t
    return state


# ---- CPU: decoded weights ---------------------------------------------------------------------------
# On a CPU the reference path would decode every layer at every call (a compressed SmolLM2 generated
# at 7% of the original's speed). Instead each layer's weight is decoded once, rotated back to the
# original basis (W = W_r · H · diag(s), so the online rotation is skipped too) and kept as a dense
# tensor in the activation dtype, while all of them fit a byte budget: half the memory available
# when the first one is decoded, or QPALETTE_CPU_DECODED_BYTES (0 turns it off). The cache is keyed
# by the stored tensors' identity and version, so loading new codes decodes again; compiled regions
# and CUDA tensors never use it.
_decoded_bytes = {"used": 0, "budget": None}


def _cpu_budget() -> int:
    env = os.environ.get("QPALETTE_CPU_DECODED_BYTES")
    if env is not None:
        return int(env)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):  # no sysconf: stay on the reference path
        return 0


def _decoded_key(layer: "QuantizedLinear", dtype: torch.dtype) -> tuple:
    tensors = [*layer.stored_tensors().values(), layer.rotation.signs]
    return (dtype, *((t.data_ptr(), t._version) for t in tensors))


def decoded_weight(layer: "QuantizedLinear", x: torch.Tensor) -> torch.Tensor | None:
    """The layer's dense weight for activations like `x` on a CPU, or None (use the ops)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    key = _decoded_key(layer, x.dtype)
    hit = layer.__dict__.get("_decoded")
    if hit is not None and hit[0] == key:
        return hit[1]
    forget_decoded(layer)
    if _decoded_bytes["budget"] is None:
        _decoded_bytes["budget"] = _cpu_budget()
    nbytes = layer.out_features * layer.in_features * x.element_size()
    if _decoded_bytes["used"] + nbytes > _decoded_bytes["budget"]:
        return None
    with torch.no_grad():
        w = unrotate_weight(layer.rotated_weight(), unpack_signs(layer.rotation.signs)).to(x.dtype)
    layer.__dict__["_decoded"] = (key, w)
    _decoded_bytes["used"] += nbytes
    return w


def forget_decoded(layer: "QuantizedLinear") -> None:
    hit = layer.__dict__.pop("_decoded", None)
    if hit is not None:
        _decoded_bytes["used"] -= hit[1].numel() * hit[1].element_size()


def decoded_bytes() -> int:
    """Bytes of decoded CPU weights held now (0: every quantized layer runs the reference ops)."""
    return _decoded_bytes["used"]


class FusedSlice(nn.Module):
    """Rows [start, stop) of a fused group's output; holds no tensors of its own."""

    def __init__(self, group: QuantizedLinear, start: int, stop: int):
        super().__init__()
        self.__dict__["group"] = group  # the group is registered on the parent, not here
        self.start, self.stop = start, stop

    @property
    def in_features(self) -> int:
        return self.group.in_features

    @property
    def qweight(self) -> torch.Tensor:
        return self.group.qweight

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.stop} of a fused {self.group.quantizer.name} group"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.shared_forward(x)[..., self.start : self.stop]


# ---- gated MLPs: down reads the gate/up group's output as it is -----------------------------------
SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"]) SiLU modules


def forward_code(forward) -> tuple:
    """A function's bytecode, names and constants, under its decorators (transformers wraps forwards
    in kwarg-renaming decorators whose wrapper code is the same for every class)."""
    code = inspect.unwrap(forward).__code__
    return code.co_code, code.co_names, tuple(c for c in code.co_consts if not inspect.iscode(c))


@functools.cache
def _plain_gated_forwards() -> frozenset:
    """The bytecode of MLP forwards that compute exactly down(act(gate(x)) · up(x)): Llama's (which
    Qwen2/3, Mistral, OLMoE … copy) and our experts'. Other MLPs with the same attributes may clamp,
    scale or normalise in between (DeepSeek-V4, Falcon-H1): they keep their own forward."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from qpalette.models.experts import ExpertMLP
    return frozenset({forward_code(LlamaMLP.forward), forward_code(ExpertMLP.forward)})


def gated_parts(mlp: nn.Module) -> tuple[QuantizedLinear, QuantizedLinear] | None:
    """(gate/up group, down) of an MLP computing down(silu(gate(x)) ⊙ up(x)) whose gate and up
    are the two halves of one fused group, gate first, and whose down is quantized; else None."""
    gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not (isinstance(gate, FusedSlice) and isinstance(up, FusedSlice) and isinstance(down, QuantizedLinear)):
        return None
    group = gate.group
    if (up.group is not group or gate.start != 0 or gate.stop != up.start or up.stop != group.out_features
            or gate.stop != down.in_features):
        return None
    if type(getattr(mlp, "act_fn", None)).__name__ not in SILU_CLASSES:
        return None
    return group, down


def _gated_mlp_forward(self: nn.Module, *args, **kwargs) -> torch.Tensor:
    parts = gated_parts(self)
    if parts is None or len(args) != 1 or kwargs or not parts[1].takes_gated(args[0]):
        return type(self).forward(self, *args, **kwargs)
    group, down = parts
    gu = group.shared_forward(args[0])
    if torch.is_grad_enabled() and gu.requires_grad:  # the gated op has no gradient: the MLP's own way
        n = down.in_features
        return down(self.act_fn(gu[..., :n]) * gu[..., n:])
    return down.gated_forward(gu)


def install_gated_mlp(mlp: nn.Module) -> bool:
    """Give a gated MLP (`gated_parts`, of a class whose forward computes nothing else:
    `_plain_gated_forwards`) a forward in which down's GEMV forms silu(gate) ⊙ up from the group's
    output itself: no elementwise kernel between the two GEMVs, and down's prologue overlaps the
    group's GEMV (programmatic dependent launch). Calls off the kernels' path (CPU, batch > the
    fused rotation's rows, entries whose GEMV cannot gate, gradients) run the MLP's own way. A
    bound method, not a closure: a deep copy of the model calls its own modules."""
    if gated_parts(mlp) is None or forward_code(type(mlp).forward) not in _plain_gated_forwards():
        return False
    mlp.forward = types.MethodType(_gated_mlp_forward, mlp)
    return True


def remove_gated_mlp(mlp: nn.Module) -> None:
    uninstall_forward(mlp, _gated_mlp_forward)


def installed_forward(module: nn.Module, func) -> bool:
    """Whether `module` runs `func` as its forward (bound on the instance by an install_* function)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is func


def uninstall_forward(module: nn.Module, func) -> None:
    """Back to the class's forward where `module` runs `func` (`installed_forward`)."""
    if installed_forward(module, func):
        del module.__dict__["forward"]


class Codebooks(_KeepsFp16):
    """The codebooks a checkpoint uses, stored once, fp16 (`tcq.q9` → buffer `tcq_q9`)."""

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = tuple(names)
        for n in self.names:
            self.register_buffer(buffer_name(n), codebook(n).to(torch.float16))

    def extra_repr(self) -> str:
        return ", ".join(self.names)

    def mismatches(self) -> list[str]:
        """Codebooks whose stored values differ from the ones this qpalette decodes with."""
        return [
            n for n in self.names
            if not torch.equal(getattr(self, buffer_name(n)).cpu().float(), codebook(n))
        ]


def buffer_name(codebook_name: str) -> str:
    return codebook_name.replace(".", "_")


def install_cache_reset(parent: nn.Module) -> None:
    """After each call of `parent`, forget the rotations and fused outputs computed in it."""
    cached = [m for m in parent.children() if isinstance(m, _CallCache)]

    def reset(_module, _args, _output):
        for m in cached:
            m.reset_cache()

    remove_cache_reset(parent)
    parent.__dict__["_qpalette_cache_reset"] = parent.register_forward_hook(reset)


def remove_cache_reset(parent: nn.Module) -> None:
    handle = parent.__dict__.pop("_qpalette_cache_reset", None)
    if handle is not None:
        handle.remove()


# ---- decoder blocks: the residual adds and RMSNorms inside the GEMVs -----------------------------
# attention classes whose forward reads its input only through q/k/v_proj (and its shape); their
# decoder layers and norms are Llama's code (Qwen2/3's and Mistral's are, `forward_code` says so)
PLAIN_ATTENTION = (("llama", "LlamaAttention"), ("qwen2", "Qwen2Attention"), ("qwen3", "Qwen3Attention"),
                   ("mistral", "MistralAttention"))


def forward_codes(classes) -> frozenset:
    """`forward_code` of the forwards of transformers' classes given as (model type, class name); those
    an older transformers lacks are left out."""
    import importlib

    codes = set()
    for module, name in classes:
        try:
            codes.add(forward_code(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                                           name).forward))
        except (ImportError, AttributeError):
            continue
    return frozenset(codes)


@functools.cache
def _plain_block_forwards() -> dict[str, frozenset]:
    """Bytecode of the modules whose forwards a fused block replaces or skips, as they compute
    nothing else: Llama's decoder layer (norm → attention → add → norm → MLP → add), the attentions
    of PLAIN_ATTENTION and LlamaRMSNorm."""
    from transformers.models.llama import modeling_llama as llama

    return {"layer": frozenset({forward_code(llama.LlamaDecoderLayer.forward)}),
            "attention": forward_codes(PLAIN_ATTENTION), "norm": frozenset({forward_code(llama.LlamaRMSNorm.forward)})}


def fused_block_parts(layer: nn.Module) -> tuple[QuantizedLinear, QuantizedLinear, QuantizedLinear] | None:
    """(q/k/v group, gate/up group, down) of a decoder layer whose q, k and v are the slices of one
    fused group and whose MLP is gated (`gated_parts`); else None. Cheap: the forward checks it on
    every call (`install_fused_block` checks the classes' code once)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    slices = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if mlp is None or not all(isinstance(s, FusedSlice) for s in slices):
        return None
    group = slices[0].group
    parts = gated_parts(mlp)
    if parts is None or slices[1].group is not group or slices[2].group is not group:
        return None
    return group, *parts


def _plain_block(layer: nn.Module) -> bool:
    """Whether the layer, its attention and its two norms are of classes whose forwards compute
    exactly Llama's (`_plain_block_forwards`)."""
    plain = _plain_block_forwards()
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (forward_code(type(layer).forward) in plain["layer"]
            and forward_code(type(layer.self_attn).forward) in plain["attention"]
            and all(n is not None and forward_code(type(n).forward) in plain["norm"] for n in norms))


def _fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    parts = fused_block_parts(self)
    if parts is None or args or torch.is_grad_enabled() or not _block_takes_fused(self, parts, hidden_states):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    qkv, gate_up, down = parts
    q_in, _ = qkv.normed_forward(hidden_states, self.input_layernorm)
    qkv.remember(hidden_states, q_in)  # q/k/v_proj(hidden_states) inside the attention: these rows
    attn_out, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    gu, h = gate_up.normed_forward(attn_out, self.post_attention_layernorm, residual=hidden_states)
    return down.gated_forward(gu, residual=h)


def _block_takes_fused(layer: nn.Module, parts: tuple, x: torch.Tensor) -> bool:
    qkv, gate_up, down = parts
    return (qkv.takes_normed(x, layer.input_layernorm) and gate_up.takes_normed(x, layer.post_attention_layernorm)
            and down.takes_gated(x))


def install_fused_block(layer: nn.Module) -> bool:
    """Give a Llama-style decoder layer (`fused_block_parts`, of a class whose forward computes
    nothing else) a forward in which the GEMVs do the block's elementwise work: q/k/v's prologue
    applies the input RMSNorm, gate/up's adds the attention output to the residual and applies
    the second RMSNorm, down's epilogue adds the residual (with silu(gate) ⊙ up in its prologue,
    `install_gated_mlp`). At batch 1 a block is then GEMVs, rope and attention only; at batch 2–8
    the rotation kernels before q/k/v, gate/up and down do that work instead (`ops.fuses_rotation`).
    Calls off that path (CPU, batch > 8, entries or sizes the GEMV cannot take, gradients, positional
    arguments) run the layer's own forward. The norms' and the MLP's own forwards (and their hooks) are skipped
    on that path. A bound method: a deep copy calls its own modules. QPALETTE_FUSED_BLOCKS=0 (read
    when a model is loaded) keeps every layer's own forward."""
    if os.environ.get("QPALETTE_FUSED_BLOCKS", "1") == "0" or fused_block_parts(layer) is None or not _plain_block(layer):
        return False
    layer.forward = types.MethodType(_fused_block_forward, layer)
    return True


def fused_block_count(model: nn.Module) -> int:
    """Decoder layers of `model` running the fused forward (`install_fused_block`)."""
    return sum(1 for m in model.modules() if installed_forward(m, _fused_block_forward))


def remove_fused_block(layer: nn.Module) -> None:
    uninstall_forward(layer, _fused_block_forward)
