"""How transformers' `generate` compiles the decode step, and a leaner way.

transformers compiles `model.__call__` with mode "reduce-overhead" (inductor + CUDA-graph trees).
Every call then runs dynamo's guards before replaying the graph, and with modules inlined those
guards cover every submodule's attributes and every parameter and buffer: thousands of checks a
call for a 32-block model, several more per quantized layer (its flags, its rotation, its code
buffers). "lean" drops the guards on nn.Module state (torch.compiler.skip_guard_on_all_nn_modules_unsafe):
safe here because a loaded model's modules do not change between decode calls (a qpalette layer's
one change, to the kernels' layout, happens at the first eager call, before anything compiles).
"deferred" compiles as lean and also lets generate read its stop flag one step late on CUDA
(`deferred_stop_check`): transformers otherwise waits for the GPU after every token, so its ~1.5 ms
of host work per step adds to the GPU's time instead of overlapping it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

MODES = ("default", "lean", "deferred")


def compile_kwargs(mode: str = "default") -> dict:
    """torch.compile keyword arguments of a decode step: CUDA graphs either way; "lean" without
    guards on module state (torch.compile refuses `mode` together with `options`, so the lean form
    spells reduce-overhead as its one inductor option)."""
    if mode == "default":
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
