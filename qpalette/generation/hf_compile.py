"""How transformers' `generate` compiles the decode step, and a leaner way.

transformers compiles `model.__call__` with mode "reduce-overhead" (inductor + CUDA-graph trees).
Every call then runs dynamo's guards before replaying the graph, and with modules inlined those
guards cover every submodule's attributes and every parameter and buffer: thousands of checks a
call for a 32-block model, several more per quantized layer (its flags, its rotation, its code
buffers). "lean" drops the guards on nn.Module state (torch.compiler.skip_guard_on_all_nn_modules_unsafe):
safe here because a loaded model's modules do not change between decode calls (a qpalette layer's
one change, to the kernels' layout, happens at the first eager call, before anything compiles).
"""

from __future__ import annotations

import torch

MODES = ("default", "lean")


def compile_kwargs(mode: str = "default") -> dict:
    """torch.compile keyword arguments of a decode step: CUDA graphs either way; "lean" without
    guards on module state (torch.compile refuses `mode` together with `options`, so the lean form
    spells reduce-overhead as its one inductor option)."""
    if mode == "default":
        return {"mode": "reduce-overhead"}
    if mode == "lean":
        return {"options": {"triton.cudagraphs": True,
                            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}}
    raise ValueError(f"compile mode {mode!r}: choose from {', '.join(MODES)}")


def compile_config(mode: str = "default"):
    """The transformers CompileConfig that makes `generate` compile its decode step this way."""
    from transformers import CompileConfig

    kw = compile_kwargs(mode)
    return CompileConfig(mode=kw.get("mode"), options=kw.get("options"))
