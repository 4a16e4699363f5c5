"""The models qpalette works on: a new architecture goes here.

topology   layer kinds, input and fusion groups, module names and shapes, unquantized parameters
walk       the layers of a model found by walking its meta-device skeleton, input groups by tracing;
           the keyword its forward takes the KV cache by
experts    MoE experts split into one linear layer per expert projection
sources    what MODEL means on the command line: a folder, a .gguf/.whl, the embedded default, a hub id
gguf       GGUF → Hugging Face safetensors
synthetic  random-weight checkpoints of a real model's shapes, for speed work
"""
