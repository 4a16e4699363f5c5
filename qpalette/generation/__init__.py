"""Generation: a static-cache decoder whose decode steps replay as CUDA graphs (decoder.py), the
next token chosen on the device (sampling.py), and text in and out around it (text.py)."""

from qpalette.generation.decoder import DecodeResult, Decoder
from qpalette.generation.sampling import SamplingOptions
from qpalette.generation.text import Generation, generate

__all__ = ["DecodeResult", "Decoder", "Generation", "SamplingOptions", "generate"]
