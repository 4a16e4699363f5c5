#!/usr/bin/env python3
"""Convert the Q-Palette paper's released tables (../shared/reference) into qpalette's formats.

    python3 scripts/import_reference_tables.py [--reference DIR] [--out profiles/reference]

Writes (JSON, atomically):
  distortion_gaussian.json          qpalette.distortion/1   (the paper's err(q), for --distortion)
  llama31_8b_sensitivity.json       qpalette.sensitivity/1  (a_l of Llama-3.1-8B's 224 layers)
  rtx4090_latency_llama31_8b.json   qpalette.latency/1      (per-block kernel latencies, batch 1)
  llama31_8b/config.json            the shape fields of Llama-3.1-8B's public config.json, so
                                    `qpalette plan profiles/reference/llama31_8b ...` works offline

Reference quantizer names map to qpalette's through the `reference_name` column of the paper's
distortion table (family vq2 → vq). Where a latency exists for both the tensor-core and the
CUDA-core kernel of an entry, the smaller is kept and `kernels` records which.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpalette.fileio import (
    atomic_write,  # noqa: E402
    sha256_file,  # noqa: E402
)
from qpalette.models.topology import layer_name, linear_layers  # noqa: E402
from qpalette.planning.inputs import LATENCY_FORMAT, SENSITIVITY_FORMAT  # noqa: E402
from qpalette.quant.distortion import DISTORTION_FORMAT  # noqa: E402
from qpalette.quant.palette import get_quantizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAMILY = {"vq2": "vq", "tcq": "tcq", "half-tcq": "half-tcq", "nuq": "nuq"}
GROUP = {"gate_up": "gateup"}

LLAMA31_8B_CONFIG = {
    "_name_or_path": "meta-llama/Llama-3.1-8B",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
    "_comment": "shape fields of the public config.json only (no weights); written by "
    "scripts/import_reference_tables.py",
}


def dump(obj, path: Path) -> None:
    atomic_write(path, json.dumps(obj, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def source(path: Path) -> dict:
    return {"file": path.name, "sha256": sha256_file(path)}


def import_distortion(ref: Path) -> tuple[dict, dict[str, str]]:
    src = ref / "distortion_gaussian.json"
    data = json.loads(src.read_text())
    rows, names = [], {}
    for r in data["rows"]:
        q = get_quantizer(f"{FAMILY[r['family']]}-{r['bits']}")
        names[r["reference_name"]] = q.name
        bound = 2.0 ** (-2 * q.bits)
        rows.append({
            "name": q.name, "family": q.family, "bits": q.bits, "nmse": r["nmse"],
            "rd_bound": bound, "gap_db": 10 * math.log10(r["nmse"] / bound), "stderr": None,
        })
    order = {"nuq": 0, "vq": 1, "tcq": 2, "half-tcq": 3}
    rows.sort(key=lambda r: (order[r["family"]], r["bits"]))
    return {
        "format": DISTORTION_FORMAT,
        "measured": {"rows": 4096, "cols": 4096, "source": "Q-Palette paper release",
                     "description": data.get("description"), "imported_from": source(src),
                     "reference_names": {v: k for k, v in names.items()}},
        "rows": rows,
    }, names


def import_sensitivity(ref: Path) -> dict:
    src = ref / "llama31_8b_sensitivity.json"
    data = json.loads(src.read_text())
    shapes = data["shapes"]
    layers = {}
    for l in linear_layers(LLAMA31_8B_CONFIG):
        name = layer_name(l.block, l.kind)
        if name not in data["coefficients"]:
            raise SystemExit(f"{src}: no coefficient for {name}")
        shp = shapes[f"{l.kind}_proj"]
        if tuple(shp) != (l.out_features, l.in_features):
            raise SystemExit(f"{src}: shape of {l.kind}_proj {shp} ≠ config's")
        layers[name] = {"a": data["coefficients"][name], "r2": None, "shape": list(shp)}
    extra = set(data["coefficients"]) - set(layers)
    if extra:
        raise SystemExit(f"{src}: unexpected layers {sorted(extra)[:3]}")
    return {
        "format": SENSITIVITY_FORMAT,
        "model": data["model"],
        "protocol": "HIGGS data-free (Q-Palette paper release; noise levels and token count "
        "not given in the release)",
        "tokens": None,
        "loss": "KL divergence (nats per token)",
        "imported_from": source(src),
        "description": data.get("description"),
        "layers": layers,
    }


def import_latency(ref: Path, names: dict[str, str]) -> dict:
    src = ref / "rtx4090_latency_llama31_8b.json"
    data = json.loads(src.read_text())
    h, kv, inter = 4096, 1024, 14336
    shapes = {"q": [h, h], "k": [kv, h], "v": [kv, h], "o": [h, h], "gate": [inter, h],
              "up": [inter, h], "down": [h, inter], "qk": [h + kv, h], "kv": [2 * kv, h],
              "qv": [h + kv, h], "qkv": [h + 2 * kv, h], "gateup": [2 * inter, h]}
    groups, kernels = {}, {}
    for g, by_kernel in data["groups"].items():
        gname = GROUP.get(g, g)
        best: dict[str, tuple[float, str]] = {}
        for kernel, row in by_kernel.items():
            for ref_name, t in row.items():
                if ref_name not in names:
                    raise SystemExit(f"{src}: {g}/{kernel}: unknown reference name {ref_name}")
                q = names[ref_name]
                if q not in best or t < best[q][0]:
                    best[q] = (t, kernel)
        groups[gname] = {q: t for q, (t, _) in sorted(best.items(), key=lambda kv_: get_order(kv_[0]))}
        kernels[gname] = {q: k for q, (_, k) in sorted(best.items(), key=lambda kv_: get_order(kv_[0]))}
    return {
        "format": LATENCY_FORMAT,
        "model": "meta-llama/Llama-3.1-8B",
        "device": "NVIDIA GeForce RTX 4090",
        "batch_size": 1,
        "constant_s": data["constant_s"],
        "units": "seconds per decode step; groups: one block's kernel call; total = Σ blocks + constant_s",
        "source": "Q-Palette paper release (reference kernels, not qpalette's)",
        "imported_from": source(src),
        "min_over_kernels": "where both a tensor-core and a CUDA-core kernel were timed, the "
        "smaller latency is kept; `kernels` says which",
        "shapes": shapes,
        "groups": groups,
        "kernels": kernels,
    }


def get_order(name: str):
    q = get_quantizer(name)
    return ({"nuq": 0, "vq": 1, "tcq": 2, "half-tcq": 3}[q.family], q.bits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, default=ROOT.parent / "shared" / "reference")
    ap.add_argument("--out", type=Path, default=ROOT / "profiles" / "reference")
    args = ap.parse_args()
    ref = args.reference
    if not ref.is_dir():
        raise SystemExit(f"reference directory {ref} not found (use --reference)")
    dist, names = import_distortion(ref)
    dump(dist, args.out / "distortion_gaussian.json")
    dump(import_sensitivity(ref), args.out / "llama31_8b_sensitivity.json")
    dump(import_latency(ref, names), args.out / "rtx4090_latency_llama31_8b.json")
    dump(LLAMA31_8B_CONFIG, args.out / "llama31_8b" / "config.json")


if __name__ == "__main__":
    main()
