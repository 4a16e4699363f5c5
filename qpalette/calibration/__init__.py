"""`qpalette calibrate`: per-layer sensitivities a_l (docs/method.md §4); `qpalette hessians`: the
input second moments H of every layer for data-aware rounding (docs/method.md §7).

sensitivity    the calibrate() run that writes the document (one device, replicas, or split)
noise          noise injection, the fit, layer_deltas (each layer's loss increases)
data           evaluation sets (text, token windows, samples of the model, BOS), shared with eval
evaluator      BlockEvaluator: KL of a perturbed model from the original over cached block inputs
placement      several devices: a whole copy of the model on each, or the model split over them
resume         the resume files of an unfinished run
hessians       the hessians run: XᵀX per input group, block by block, resumable
blockstream    a model run one block at a time from its safetensors (meta skeleton)
hessian_files  the Hessian folder's format: writing, reading, checking it against a model
"""
