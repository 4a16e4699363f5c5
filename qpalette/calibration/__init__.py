"""`qpalette calibrate`: per-layer sensitivities a_l (docs/method.md §4); `qpalette hessians`: the
input second moments H of every layer for data-aware rounding (docs/method.md §7).

sensitivity    noise, fit, run_layers and the calibrate() run that writes the document
data           evaluation sets (text, token windows, samples of the model, BOS), shared with eval
evaluator      BlockEvaluator: KL of a perturbed model from the original over cached block inputs
workers        one process per device for multi-device runs
resume         the resume files of an unfinished run
hessians       the hessians run: XᵀX per input group, block by block, resumable
blockstream    a model run one block at a time from its safetensors (meta skeleton)
hessian_files  the Hessian folder's format: writing, reading, checking it against a model
"""
