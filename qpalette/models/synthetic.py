"""Write a random-weight Hugging Face checkpoint with a real model's shapes (no real weights needed).

    python scripts/make_synthetic_model.py OUT_DIR [--config llama-3.1-8b|PATH] [--layers N]
        [--seed 0] [--std 0.02] [--shard-gb 2] [--tokenizer byte|DIR] [--force]

For speed work (`qpalette bench`, kernels) and for `qpalette compress` without the real 8B weights:
`--config llama-3.1-8b` (default) takes the Llama-3.1-8B shapes from
profiles/reference/llama31_8b/config.json (plus that model's rope/norm settings); PATH is any
config.json (or a folder holding one). `--layers N` keeps only the first N decoder blocks (a
1-block 8B model is ≈2.5 GB: embeddings and lm_head dominate).

Weights: every matrix (embeddings and lm_head included) ~ N(0, std²) in float16, norm weights 1,
biases 0. Each tensor has its own generator seeded from (seed, tensor name), so the first N blocks
of a `--layers N` model equal those of the full model. Nothing is held beyond the shard being
written: tensors are generated in model order (block by block) into float16 safetensors shards
of at most --shard-gb GB (≈2 GB: the 8B model is 9 shards, 16.06 GB), with the usual
model.safetensors.index.json. The output is written to OUT_DIR.partial and renamed when complete.

Tokenizer: `byte` (default) is a 257-token byte-level BPE with no merges (256 bytes + <s>, which
is BOS and EOS; the config's bos/eos ids are set to it), so any text works; `--tokenizer DIR`
copies a real tokenizer instead (e.g. Llama-3.1's, if you have it). Needs torch, transformers,
safetensors, tokenizers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

from qpalette.errors import InputError
from qpalette.fileio import folder_written_whole
from qpalette.quant.codebooks import profiles_dir

CONFIGS = {"llama-3.1-8b": ("reference", "llama31_8b", "config.json"),  # under the shipped profiles/
           "qwen3-30b-a3b": ("reference", "qwen3_30b_a3b", "config.json")}  # MoE: 128 experts, top 8
CONFIG_ALIASES = {"llama31-8b": "llama-3.1-8b", "llama3.1-8b": "llama-3.1-8b", "llama-3-8b": "llama-3.1-8b",
                  "qwen3-moe": "qwen3-30b-a3b"}
# What the shapes-only reference config leaves out (the public Llama-3.1-8B config.json values).
LLAMA31_8B_EXTRA = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu",
}
_DROP = ("_comment", "_name_or_path", "torch_dtype", "dtype", "transformers_version")


# --------------------------------------------------------------------------- config


def load_config_dict(spec: str) -> tuple[dict, str]:
    """(config dict, source description) for a known name or a config.json path/folder."""
    name = CONFIG_ALIASES.get(spec.lower(), spec.lower())
    extra = {}
    if name in CONFIGS:
        path, extra = profiles_dir().joinpath(*CONFIGS[name]), LLAMA31_8B_EXTRA
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise InputError(f"--config {spec}: neither a known name ({', '.join(CONFIGS)}) nor a "
                                 "config.json file or folder")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise InputError(f"{path}: not a Hugging Face config.json (no model_type)")
    for k, v in extra.items():
        d.setdefault(k, v)
    return d, (name if name in CONFIGS else str(path))


def build_config(d: dict, layers: int | None):
    from transformers import AutoConfig

    d = {k: v for k, v in d.items() if k not in _DROP}
    if layers is not None:
        if layers < 1:
            raise InputError("--layers must be at least 1")
        d["num_hidden_layers"] = layers
        d.pop("layer_types", None)  # per-layer lists of the full model no longer fit
    model_type = d.pop("model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except Exception as e:  # noqa: BLE001 - unknown model_type or invalid fields
        raise InputError(f"cannot build a '{model_type}' config: {e}") from None
    cfg.architectures = d.get("architectures") or cfg.architectures
    return cfg


# --------------------------------------------------------------------------- tensors


def tensor_specs(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter the checkpoint stores, in model order (tied lm_head left out);
    MoE experts one matrix per expert and projection, as the published checkpoints store them."""
    import torch
    from transformers import AutoModelForCausalLM

    from qpalette.models.experts import unfuse_experts

    with torch.device("meta"):
        model = unfuse_experts(AutoModelForCausalLM.from_config(cfg))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if tied and name == "lm_head.weight":
            continue
        out.append((name, tuple(p.shape)))
    return out


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def make_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, chunk_elems: int = 1 << 26):
    """float16: ones for norm weights, zeros for biases, N(0, std²) otherwise (in row chunks)."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape, dtype=torch.float16)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=torch.float16)
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    out = torch.empty(shape, dtype=torch.float16)
    flat = out.view(-1)
    for i in range(0, flat.numel(), chunk_elems):  # bounded float32 scratch (embeddings: 0.5 B weights)
        n = min(chunk_elems, flat.numel() - i)
        flat[i: i + n] = torch.randn(n, generator=g, dtype=torch.float32).mul_(std).to(torch.float16)
    return out


def plan_shards(specs, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most shard_bytes (a bigger tensor gets its own)."""
    shards, cur, size = [], [], 0
    for name, shape in specs:
        nbytes = 2 * math.prod(shape)
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


# --------------------------------------------------------------------------- tokenizer


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<s>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="<s>")


def get_tokenizer(spec: str):
    if spec == "byte":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"cannot load a tokenizer from {spec}: {str(e).splitlines()[0][:200]}") from None


# --------------------------------------------------------------------------- the writer


def _config_and_tokenizer(config: str, layers: int | None, tokenizer: str):
    """(transformers config with the tokenizer's BOS/EOS and float16, tokenizer, config source)."""
    d, source = load_config_dict(config)
    cfg = build_config(d, layers)
    tok = get_tokenizer(tokenizer)
    if len(tok) > cfg.vocab_size:
        raise InputError(f"the tokenizer has {len(tok)} tokens, more than the config's vocab_size {cfg.vocab_size}")
    if tokenizer == "byte" or tok.bos_token_id is not None:
        cfg.bos_token_id = tok.bos_token_id
        cfg.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id
    cfg.dtype = "float16"
    return cfg, tok, source


def _write_shards(folder: Path, shards, seed: int, std: float, log) -> dict[str, str]:
    """Every shard's tensors, generated one shard at a time; the weight map."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    weight_map = {}
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        tensors = {name: make_tensor(name, shape, seed, std) for name, shape in shard}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        os.chmod(folder / fname, 0o644)
        weight_map.update({name: fname for name in tensors})
        size = sum(t.numel() * 2 for t in tensors.values())
        del tensors
        log(f"  wrote {fname} ({len(shard)} tensors, {size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)")
    return weight_map


def make_synthetic_model(out_dir: str | Path, config: str = "llama-3.1-8b", layers: int | None = None,
                         seed: int = 0, std: float = 0.02, shard_gb: float = 2.0, tokenizer: str = "byte",
                         force: bool = False, log=print) -> Path:
    """Write the checkpoint (see module doc) to OUT_DIR.partial, renamed when complete; returns OUT_DIR."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise InputError(f"{out} exists and is not empty (pass --force to replace it)")
    if not (std > 0) or not (shard_gb > 0):
        raise InputError("--std and --shard-gb must be positive")
    cfg, tok, source = _config_and_tokenizer(config, layers, tokenizer)
    specs = tensor_specs(cfg)
    shards = plan_shards(specs, int(shard_gb * 1e9))
    total = sum(2 * math.prod(s) for _n, s in specs)
    log(f"{source}: {cfg.num_hidden_layers} blocks, {sum(math.prod(s) for _n, s in specs) / 1e9:.3f} B "
        f"parameters, {total / 1e9:.2f} GB float16 in {len(shards)} shard(s) → {out}")
    t0 = time.perf_counter()
    with folder_written_whole(out) as tmp:
        weight_map = _write_shards(tmp, shards, seed, std, log)
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "qpalette_source.json").write_text(json.dumps({
            "synthetic": True, "config": source, "layers": cfg.num_hidden_layers, "seed": seed, "std": std,
            "tokenizer": tokenizer, "note": "random weights ~ N(0, std^2) float16, norms 1, biases 0 "
                                            "(qpalette.models.synthetic); not a trained model",
        }, indent=1) + "\n")
    log(f"done in {time.perf_counter() - t0:.1f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="folder to write (must not exist or be empty, unless --force)")
    ap.add_argument("--config", default="llama-3.1-8b", help="llama-3.1-8b, or a config.json (or its folder)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the weights")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="largest shard, GB (1e9 bytes)")
    ap.add_argument("--tokenizer", default="byte", help="byte (257-token byte-level BPE) or a folder to copy")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = ap.parse_args(argv)
    try:
        make_synthetic_model(args.out_dir, args.config, args.layers, args.seed, args.std, args.shard_gb,
                             args.tokenizer, args.force)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
