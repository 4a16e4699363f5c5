"""The models qpalette works on: a new architecture goes here.

topology   layer kinds, input and fusion groups, module names and shapes, from config.json alone
sources    what MODEL means on the command line: a folder, a .gguf/.whl, the embedded default, a hub id
gguf       GGUF → Hugging Face safetensors
synthetic  random-weight checkpoints of a real model's shapes, for speed work
"""
