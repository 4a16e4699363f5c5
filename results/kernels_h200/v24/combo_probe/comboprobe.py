"""Kernel launches of a compiled decode step of a tiny Llama (FP16, qpalette attention, 8 layers,
batch 8), with and without inductor's combo kernels: do the per-layer `length.add_(1)` kernels
collapse into fewer launches?

    python comboprobe.py 0|1   (1: torch._inductor.config.combo_kernels = True)
"""
import json
import sys

import torch
import torch._inductor.config as ic
from transformers import LlamaConfig, LlamaForCausalLM

import qpalette  # noqa: F401
from qpalette.generation.attention import use_packed_attention
from qpalette.measure.breakdown import breakdown

combo = sys.argv[1] == "1"
ic.combo_kernels = combo
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, vocab_size=1000, attn_implementation="sdpa")
m = LlamaForCausalLM(cfg).half().cuda().eval()
print("packed", use_packed_attention(m))
r = breakdown(m, 8, 8, prompt_len=16)
print(json.dumps({"combo": combo, "kernels_per_step": r["kernels_per_step"], "kernel_sum_us": r["kernel_sum_s"] * 1e6,
                  "top": {k: [v * 1e6, r["top_kernel_launches_per_step"][k]] for k, v in r["top_kernels_s"].items()}},
                 indent=1))
