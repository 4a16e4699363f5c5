"""Measuring models and kernels.

evaluate   perplexity and data-free KL (`qpalette eval`)
bench      decode tokens/s: generate and the compiled forward loop (`qpalette bench`)
timing     kernel timing under CUDA-graph replay with L2 defeated
profile    latency profiles for speed budgets (`qpalette profile`)
breakdown  where a decode step's GPU time goes, by kernel kind
"""
