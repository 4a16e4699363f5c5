#!/usr/bin/env python3
"""The FP16/BF16 baseline of an MoE model with transformers' own fused experts, timed by the same
harness as `qpalette bench` (qpalette's decoder, transformers' generate, the compiled forward loop).

    python scripts/bench_hf_experts.py MODEL_DIR [--experts batched_mm,grouped_mm] [--dtype float16]
        [--batch-sizes 1,8] [--prompt-len 16] [--gen-len 32] [--ways decoder,generate,loop] [--json OUT]

Why a script beside `qpalette bench`: qpalette loads an original MoE model with one linear layer
per expert (what calibrate and compress need), whose forward loops over the experts hit and reads
the router's choice back to the host every block — no CUDA graph, and an unfair baseline.
transformers keeps the experts fused and offers sync-free implementations: "batched_mm" gathers
each (token, choice)'s expert weights and runs one batched matmul (any dtype; the gather copies
the weights it reads), "grouped_mm" sorts the tokens by expert for torch's grouped GEMM (bfloat16
under torch.compile). Rows as in `qpalette bench --json`, one per (implementation, batch size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def measure(model, batch: int, prompt_len: int, gen_len: int, ways: list[str]) -> dict:
    from qpalette.measure.bench import decode_loop_times, decode_step_times, decoder_times

    row: dict = {"batch_size": batch}
    if "decoder" in ways:
        row.update(decoder_times(model, batch, prompt_len, gen_len, 0))
    if "generate" in ways:
        step = statistics.median(decode_step_times(model, batch, prompt_len, gen_len, True, 0))
        row.update({"step_s": step, "tok_per_s": 1 / step, "throughput_tok_per_s": batch / step})
    if "loop" in ways:
        loop, host = decode_loop_times(model, batch, prompt_len, gen_len, "reduce-overhead", 0)
        row.update({"loop_step_s": loop, "loop_tok_per_s": 1 / loop, "loop_throughput_tok_per_s": batch / loop,
                    "loop_host_s": host})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--experts", default="batched_mm,grouped_mm", help="transformers experts implementations")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--ways", default="decoder,generate,loop")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_hf_experts: needs a CUDA GPU")
    from transformers import AutoModelForCausalLM

    import qpalette  # noqa: F401  (registers qpalette's model types and kernels)

    rows = []
    for impl in a.experts.split(","):
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype),
                                                     experts_implementation=impl).cuda().eval()
        for b in (int(x) for x in a.batch_sizes.split(",")):
            try:
                row = {"experts": impl, "dtype": a.dtype, **measure(model, b, a.prompt_len, a.gen_len,
                                                                       a.ways.split(","))}
            except Exception as e:  # noqa: BLE001  (one implementation failing must not hide the others)
                row = {"experts": impl, "dtype": a.dtype, "batch_size": b, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        del model
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"format": "qpalette.bench_hf_experts/1", "model": a.model,
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
