"""How transformers' `generate` compiles the decode step, and a leaner way.

transformers compiles `model.__call__` with mode "reduce-overhead" (inductor + CUDA-graph trees).
Every call then runs dynamo's guards before replaying the graph, and with modules inlined those
guards cover every submodule's attributes and every parameter and buffer: thousands of checks a
call for a 32-block model, several more per quantized layer (its flags, its rotation, its code
buffers). "lean" drops the guards on nn.Module state (torch.compiler.skip_guard_on_all_nn_modules_unsafe):
safe for one loaded model whose modules do not change between decode calls (a qpalette layer's
one change, to the kernels' layout, happens at the first eager call, before anything compiles),
not across models: another model of the same class reuses the compiled code unless
torch._dynamo.reset() runs in between.
"deferred" compiles as lean and also lets generate read its stop flag one step late on CUDA
(`deferred_stop_check`): transformers otherwise waits for the GPU after every token, so its ~1.5 ms
of host work per step adds to the GPU's time instead of overlapping it. A loaded qpalette model's
own `generate` defers the stop check by itself (`deferring_generate`; QPALETTE_DEFERRED_STOP=0
turns that off); lean stays opt-in, since it trusts that modules do not change between calls.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch

#: "plain" is no mode of ours: generate exactly as a user calls it (the model's own compile config,
#: and for a qpalette model its deferred stop check)
MODES = ("default", "lean", "deferred", "plain")
#: whether an enclosing `deferred_stop_check` block has decided (None: none has)
_STOP_CHECK_CHOSEN: ContextVar[bool | None] = ContextVar("qpalette_deferred_stop_check", default=None)


def compile_kwargs(mode: str = "default") -> dict:
    """torch.compile keyword arguments of a decode step: CUDA graphs either way; "lean" without
    guards on module state (torch.compile refuses `mode` together with `options`, so the lean form
    spells reduce-overhead as its one inductor option)."""
    if mode in ("default", "plain"):
        return {"mode": "reduce-overhead"}
    if mode in ("lean", "deferred"):
        return {"options": {"triton.cudagraphs": True,
                            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}}
    raise ValueError(f"compile mode {mode!r}: choose from {', '.join(MODES)}")


def compile_config(mode: str = "default"):
    """The transformers CompileConfig that makes `generate` compile its decode step this way."""
    from transformers import CompileConfig

    kw = compile_kwargs(mode)
    return CompileConfig(mode=kw.get("mode"), options=kw.get("options"))


@contextmanager
def deferred_stop_check(enabled: bool = True):
    """Within the block, transformers' `generate` on CUDA checks whether to stop one step late, as
    its own DeferredStopCheck does on Apple GPUs only (transformers ≥ 5.17: "we should enable it for
    cuda if we observe perf gains"; measured: results/generate_h100/README.md). The flag is copied
    to the host without waiting, so the host queues step t+1 while the GPU runs step t; the extra
    step this costs is undone by transformers. Yields whether it is in effect (False on a
    transformers without DeferredStopCheck, or when not `enabled`)."""
    chosen = _STOP_CHECK_CHOSEN.set(enabled)
    try:
        with _deferring(enabled) as on:
            yield on
    finally:
        _STOP_CHECK_CHOSEN.reset(chosen)


@contextmanager
def _deferring(enabled: bool):
    from transformers.generation import utils

    cls = getattr(utils, "DeferredStopCheck", None)
    if not enabled or cls is None or "is_supported" not in cls.__dict__:
        yield False
        return
    original = cls.__dict__["is_supported"]

    def is_supported(device, cache, cache_is_returned, is_assistant=False):
        if device.type == "cuda" and not is_assistant:
            return cache is None or cache.is_croppable or not cache_is_returned
        return original.__func__(device, cache, cache_is_returned, is_assistant=is_assistant)

    cls.is_supported = staticmethod(is_supported)
    try:
        yield True
    finally:
        cls.is_supported = original


def mode_stop_check(mode: str):
    """The stop check a compile mode runs generate under: deferred for "deferred", transformers'
    own for "default" and "lean", and for "plain" whatever the model's generate chooses itself."""
    return nullcontext() if mode == "plain" else deferred_stop_check(mode == "deferred")


def _generate_deferring_stop(self, *args, **kwargs):
    """`generate` of a loaded qpalette model: transformers' own, its stop check deferred on CUDA
    unless a `deferred_stop_check` block around the call has decided (as `qpalette bench` does)."""
    generate = type(self).generate
    if _STOP_CHECK_CHOSEN.get() is not None:
        return generate(self, *args, **kwargs)
    with deferred_stop_check(os.environ.get("QPALETTE_DEFERRED_STOP", "1") != "0"):
        return generate(self, *args, **kwargs)


def deferring_generate(model) -> None:
    """Make `model.generate` defer transformers' stop check (an instance method: a bound method,
    so copy.deepcopy rebinds it to the copy)."""
    model.generate = types.MethodType(_generate_deferring_stop, model)
