#!/usr/bin/env python3
"""A compressed checkpoint generates the same greedy text on the CUDA kernels as
on the CPU reference path, and under torch.compile with a static KV cache.

    python3 scripts/check_greedy.py MODEL_DIR [--tokens 24] [--json out.json]

MODEL_DIR is a qpalette checkpoint, or an original model as the control: the same comparison
without qpalette (cuBLAS fp16 vs CPU float32) shows which flips come from fp16 alone.

CPU: float32, pure-PyTorch reference. GPU: float16 activations on the qpalette kernels, eager
and then `generate(cache_implementation="static")` (transformers compiles the decode step,
mode reduce-overhead = CUDA graphs). Prints, per prompt, where the token streams first differ
(fp16 vs fp32 rounding can flip a near-tie; the logit margin at that step is printed).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from qpalette.runtime.loading import load_model

    tok = AutoTokenizer.from_pretrained(args.model)
    cpu = load_model(args.model, "cpu", tokenizer=False)[0]  # float32; qpalette's reference path
    gpu = load_model(args.model, "cuda", tokenizer=False)[0]  # float16; qpalette's kernels
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    rows = []
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ref = cpu.generate(**enc, **kw)[0].tolist()
            eager = gpu.generate(**enc.to("cuda"), **kw, disable_compile=True)[0].tolist()
            t0 = time.time()
            comp = gpu.generate(**enc.to("cuda"), **kw, cache_implementation="static")[0].tolist()
            comp_s = time.time() - t0
        n0 = enc["input_ids"].shape[1]
        first = lambda a, b: next((i - n0 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)  # noqa: E731
        row = {"prompt": prompt, "cpu": tok.decode(ref[n0:]), "gpu_eager_same": eager == ref,
               "gpu_compiled_same": comp == ref, "first_diff_eager": first(ref, eager),
               "first_diff_compiled": first(ref, comp), "compiled_first_call_s": round(comp_s, 1)}
        d = row["first_diff_eager"]
        if d is not None:  # margin of the CPU model's top-2 logits at the divergent step
            with torch.no_grad():
                logits = cpu(torch.tensor([ref[: n0 + d]])).logits[0, -1]
            top = logits.topk(2).values
            row["cpu_top2_margin_at_diff"] = float(top[0] - top[1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = all(r["gpu_eager_same"] and r["gpu_compiled_same"] for r in rows)
    print("greedy text identical on CPU reference, GPU kernels and GPU compiled:", ok)
    if args.json:
        json.dump({"rows": rows, "identical": ok}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
