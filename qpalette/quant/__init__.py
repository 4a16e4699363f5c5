"""Quantizers and what they are made of (docs/method.md §1–§3); imports nothing above it.

palette/     the 34 entries (NUQ, VQ, TCQ, half-TCQ) by name: a new quantizer goes here
trellis      the bitshift trellis of TCQ: state values, tail-biting Viterbi, code streams
codebooks    the shipped codebooks (and the k-means that builds them)
bitpack      MSB-first bit streams in int32 words
tiles        16×16 tiles in tensor-core fragment order
hadamard     Hadamard matrices of order K·2^m and the fast transform
incoherence  random signs + Hadamard: rotating weights and activations
distortion   the data-free distortion table (`qpalette.distortion/1`)
rtn          round-to-nearest with groups, a reference point for comparisons
"""
