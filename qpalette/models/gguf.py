"""GGUF → Hugging Face: a llama-architecture GGUF file dequantized into a float32 safetensors folder.

Tensors are dequantized with the `gguf` package (exact for Q4_1/Q8_0: d·q + m with fp16 d, m fits
in float32), llama.cpp's rotary permutation of q/k rows is undone, and a `LlamaForCausalLM`
checkpoint with the GGUF's own tokenizer is written (to TARGET.partial, renamed when complete).
"""

from __future__ import annotations

import json
from pathlib import Path

from qpalette.errors import ModelError
from qpalette.fileio import folder_written_whole

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w, n_head: int):
    """Undo llama.cpp's rotary permutation of q/k rows (HF half-split → interleaved)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(path: Path):
    """(LlamaConfig kwargs, {hf name: float32 numpy array}) from a llama-architecture GGUF."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 — gguf raises many kinds for a damaged file
        raise ModelError(f"cannot read GGUF file {path}: {e}") from None
    config = _llama_config(path, _metadata(reader), reader)
    n_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    return config, {name: arr for name, arr in _tensors(path, reader, n_heads)}


def _metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            meta[key] = len(field.data)
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 — fields of types we do not read
            pass
    return meta


def _llama_config(path: Path, meta: dict, reader) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{path.name}: GGUF architecture '{arch}' is not supported (only llama)")
    required = ("llama.attention.head_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.block_count")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ModelError(f"{path.name}: GGUF metadata lacks {', '.join(missing)}")
    vocab = meta.get("llama.vocab_size") or meta.get("tokenizer.ggml.tokens") or next(
        (int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), None)
    n_head = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=n_head,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", n_head)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        max_position_embeddings=int(meta.get("llama.context_length", 2048)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )


_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _tensors(path: Path, reader, n_heads: dict[str, int]):
    """(hf name, float32 array) of every tensor, q/k rows back in Hugging Face order."""
    import numpy as np
    from gguf.quants import dequantize

    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape(tuple(int(s) for s in reversed(t.shape.tolist())))
        if t.name in _TOP_LEVEL:
            hf = _TOP_LEVEL[t.name]
        elif t.name.startswith("blk.") and t.name.split(".")[2] in _GGUF_NAMES:
            _, idx, kind, leaf = t.name.split(".", 3)
            hf = f"model.layers.{idx}.{_GGUF_NAMES[kind]}.{leaf}"
            if kind in n_heads:
                arr = _unpermute(arr, n_heads[kind])
        else:
            raise ModelError(f"{path.name}: unexpected tensor {t.name}")
        yield hf, np.array(arr, dtype=np.float32, order="C", copy=True)


def convert_gguf(gguf: Path, target: Path, say) -> Path:
    """Write a float32 safetensors LlamaForCausalLM + tokenizer for `gguf` into `target`."""
    if target.is_dir() and (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    say(f"qpalette: converting {gguf.name} → {target} (float32 safetensors, once)")
    cfg_kwargs, tensors = gguf_state_dict(gguf)
    rope_theta = cfg_kwargs.pop("rope_theta")
    config = LlamaConfig(**cfg_kwargs)
    # transformers 5 keeps rope settings in rope_parameters; older versions in rope_theta.
    if hasattr(config, "rope_parameters") and isinstance(getattr(config, "rope_parameters"), dict):
        config.rope_parameters["rope_theta"] = rope_theta
    config.rope_theta = rope_theta
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    missing = set(model.state_dict()) - set(state) - {"lm_head.weight"}
    if missing:
        raise ModelError(f"{gguf.name}: tensors missing after conversion: {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:
        raise ModelError(f"cannot build the tokenizer from {gguf.name}: {e}") from None
    with folder_written_whole(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "qpalette_source.json").write_text(
            json.dumps({"gguf": gguf.name, "note": "dequantized GGUF, float32"}, indent=1)
        )
    say(f"qpalette: model ready in {target}")
    return target


