"""qpalette: mixed-scheme weight quantization (NUQ, VQ, TCQ, half-TCQ) for causal LMs.

The library API (qpalette.api, re-exported here) is what the `qpalette` command line calls:
`calibrate`, `hessians`, `plan` (`load_plan`, `describe_plan`), `compress`, `quantize` (in memory), `from_pretrained`, `load_model`,
`generate`, `evaluate`, `bench`, `profile`, `palette`; `compile_config` and `deferred_stop_check` for
transformers' own `generate` (qpalette.generation.hf_compile); and the versioned configs of the steps that
record their recipe (`CalibrateConfig`, `PlanConfig`, `CompressConfig`, qpalette.config).

Importing qpalette registers `quant_method: "qpalette"` with transformers, so that
`AutoModelForCausalLM.from_pretrained(DIR)` loads checkpoints written by `qpalette compress`. The
registration runs when transformers is imported (at once if it already is), so importing a part
of qpalette that does not need transformers (`qpalette.quant`, say) does not load it.
"""

import sys

import wrapt

from qpalette.api import (
    bench,
    calibrate,
    compress,
    describe_plan,
    evaluate,
    from_pretrained,
    generate,
    hessians,
    load_model,
    load_plan,
    loss_table,
    palette,
    plan,
    profile,
    quantize,
)
from qpalette.config import CalibrateConfig, CompressConfig, PlanConfig
from qpalette.generation.hf_compile import compile_config, deferred_stop_check
from qpalette.version import __version__


def register() -> None:
    """Add qpalette to transformers' quantization registries (idempotent)."""
    importing = sys.modules.get("qpalette.runtime.hf_quantizer")
    if importing is not None and not hasattr(importing, "register"):
        return  # transformers was first imported by hf_quantizer itself, which registers when done
    from qpalette.runtime.hf_quantizer import register as add_to_transformers

    add_to_transformers()


wrapt.register_post_import_hook(lambda _transformers: register(), "transformers")

__all__ = ["CalibrateConfig", "CompressConfig", "PlanConfig", "__version__", "bench", "calibrate", "compile_config", "compress",
           "deferred_stop_check", "describe_plan", "evaluate", "from_pretrained", "generate",
           "hessians", "load_model", "load_plan", "loss_table", "palette", "plan", "profile", "quantize", "register"]
