"""qpalette: mixed-scheme weight quantization (NUQ, VQ, TCQ, half-TCQ) for causal LMs."""

__version__ = "0.1.0"
