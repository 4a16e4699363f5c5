"""Generation: a static-cache decoder whose decode steps replay as CUDA graphs (decoder.py), the
next token chosen on the device (sampling.py), text in and out around it (text.py), and the same
decoder behind transformers' `generate` (hf_generate.py, `custom_generate=hf_decode`)."""

from qpalette.generation.decoder import Decoder, DecodeResult
from qpalette.generation.hf_generate import hf_decode
from qpalette.generation.sampling import SamplingOptions
from qpalette.generation.text import Generation, generate

__all__ = ["DecodeResult", "Decoder", "Generation", "SamplingOptions", "generate", "hf_decode"]
