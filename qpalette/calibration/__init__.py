"""`qpalette calibrate`: per-layer sensitivities a_l (docs/method.md §4).

sensitivity  noise, fit, run_layers and the calibrate() run that writes the document
data         evaluation sets (text, token windows, samples of the model, BOS), shared with eval
evaluator    BlockEvaluator: KL of a perturbed model from the original over cached block inputs
workers      one process per device for multi-device runs
resume       the resume files of an unfinished run
progress     the progress bar
"""
