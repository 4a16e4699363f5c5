"""qpalette: mixed-scheme weight quantization (NUQ, VQ, TCQ, half-TCQ) for causal LMs.

Importing qpalette registers `quant_method: "qpalette"` with transformers, so that
`AutoModelForCausalLM.from_pretrained(DIR)` loads checkpoints written by `qpalette compress`.
"""

__version__ = "0.1.0"

from qpalette.runtime.hf_quantizer import from_pretrained, register  # noqa: E402

register()

__all__ = ["__version__", "from_pretrained", "register"]
