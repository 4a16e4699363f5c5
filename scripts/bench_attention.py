#!/usr/bin/env python3
"""Decode attention, one layer, Llama-3.1-8B heads (32 query heads over 8 KV heads, dim 128): µs
per call of transformers' sdpa path (the cache repeated to every query head, then SDPA), SDPA on
the packed heads, and qpalette::decode_attention, side by side at each batch size and cache
length. Each time is one call under CUDA-graph replay over enough layers' caches to miss L2
(qpalette.measure.timing), with the bytes of K and V read once as the roofline.

    python scripts/bench_attention.py [--batches 1,8] [--lengths 128,1024,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpalette.measure import timing  # noqa: E402
from qpalette.runtime import decode_attention as da  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


def transformers_sdpa(q, k, v, mask, scale):
    from transformers.integrations.sdpa_attention import repeat_kv

    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], repeat_kv(k, g), repeat_kv(v, g),
                                                           attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0]


WAYS = {"transformers sdpa": transformers_sdpa, "packed sdpa": da.packed_sdpa,
        "qpalette kernel": lambda *a: da.decode_attention(*a)}


def row(batch: int, length: int, copy_bw: float) -> dict:
    cache_bytes = 2 * batch * KV_HEADS * length * DIM * 2
    layers = timing.copies_for(cache_bytes)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.float16)
    caches = [(torch.randn(batch, KV_HEADS, length, DIM, device="cuda", dtype=torch.float16),
               torch.randn(batch, KV_HEADS, length, DIM, device="cuda", dtype=torch.float16)) for _ in range(layers)]
    mask = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    mask[:, length * 3 // 4:] = False  # a cache not yet full
    out = {"batch": batch, "length": length, "roofline_us": cache_bytes / copy_bw * 1e6}
    want = da.reference(q, *caches[0], mask, DIM ** -0.5).float()
    for name, fn in WAYS.items():
        got = fn(q, *caches[0], mask, DIM ** -0.5).float()
        out[f"{name} max_err"] = (got - want).abs().max().item()
        out[f"{name} us"] = timing.time_graph([lambda kv=kv: fn(q, *kv, mask, DIM ** -0.5) for kv in caches]) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    bw = timing.copy_bandwidth()
    rows = []
    print(f"{'batch':>5} {'keys':>6} {'roofline':>9} " + " ".join(f"{w:>18}" for w in WAYS) + "  (µs a layer)")
    for b in (int(x) for x in a.batches.split(",")):
        for length in (int(x) for x in a.lengths.split(",")):
            r = row(b, length, bw)
            rows.append(r)
            print(f"{b:5d} {length:6d} {r['roofline_us']:9.1f} " + " ".join(f"{r[f'{w} us']:18.1f}" for w in WAYS))
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "rows": rows},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
