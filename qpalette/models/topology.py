"""Linear-layer shapes of Llama-style decoder models, from a Hugging Face config.json alone.

No weights, no hub, no torch: `qpalette plan` and the compressor use this to know which linear
layers a model has ([out_features, in_features], block, kind), which layers share an input (and so
one sign vector, docs/method.md §1), and how many parameters stay unquantized (embeddings, lm_head, norms,
biases).

Supported: Llama, Mistral, Qwen2 and Qwen3 style decoders (dense, no MoE). Their layers are named
`model.layers.{i}.self_attn.{q,k,v,o}_proj` and `model.layers.{i}.mlp.{gate,up,down}_proj`. The
output projection `lm_head` is a layer too when asked for (`linear_layers(cfg, lm_head=True)`): kind
`head`, counted as block `num_hidden_layers` (after the last decoder block), its own input group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from qpalette.errors import ModelError
from qpalette.fileio import read_json_object

BLOCK_KINDS = ("q", "k", "v", "o", "gate", "up", "down")
KINDS = BLOCK_KINDS + ("head",)
#: the output projection's name and kind (quantized only when a plan or scheme asks for it)
HEAD = "lm_head"
#: layers that read the same input share one sign vector and one online transform
INPUT_GROUPS = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gateup", "up": "gateup",
                "down": "down", "head": "head"}
#: the order of a block's input groups (it numbers their sign seeds, docs/format.md)
INPUT_GROUP_ORDER = ("qkv", "o", "gateup", "down", "head")
#: the module holding each input group's online rotation, beside the layers it feeds
ROTATION_MODULES = {"qkv": "rotate_qkv", "o": "rotate_o", "gateup": "rotate_gate_up", "down": "rotate_down",
                    "head": "rotate_lm_head"}

#: fusion groups of one block (docs/method.md §5) → the layer kinds they cover, in
#: row-concatenation order. Plans and latency profiles name groups by these keys.
GROUPS: dict[str, tuple[str, ...]] = {
    "q": ("q",), "k": ("k",), "v": ("v",), "o": ("o",),
    "gate": ("gate",), "up": ("up",), "down": ("down",),
    "qk": ("q", "k"), "kv": ("k", "v"), "qv": ("q", "v"), "qkv": ("q", "k", "v"),
    "gateup": ("gate", "up"), "head": ("head",),
}
SINGLE_GROUPS = ("q", "k", "v", "o", "gate", "up", "down", "head")
FUSED_GROUPS = ("qk", "kv", "qv", "qkv", "gateup")
#: the module a fused group is stored and run as in a compressed checkpoint
GROUP_MODULES = {"qk": "qk_proj", "qv": "qv_proj", "kv": "kv_proj", "qkv": "qkv_proj",
                 "gateup": "gate_up_proj"}
#: other spellings of group keys accepted in files
GROUP_ALIASES = {"gate_up": "gateup", "q_k": "qk", "k_v": "kv", "q_v": "qv", "q_k_v": "qkv"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
UNQUANTIZED_BYTES_PER_PARAM = 2  # embeddings, lm_head, norms, biases stay in fp16/bf16

_NAME_RE = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<block>\d+)\.(?:self_attn|mlp)\.(?P<kind>q|k|v|o|gate|up|down)_proj$"
)


@dataclass(frozen=True)
class LayerShape:
    name: str
    out_features: int
    in_features: int
    block: int
    kind: str  # q, k, v, o, gate, up, down

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def input_group(self) -> str:
        return INPUT_GROUPS[self.kind]


def group_key(kinds: list[str]) -> str:
    """The fusion group of these member kinds: 'qkv' for [q, k, v], 'gateup' for [gate, up]."""
    return "".join(kinds)


def group_module(layer: str, kinds: list[str]) -> str:
    """Module name of the fused group of `kinds` beside `layer`: …self_attn.qkv_proj."""
    return f"{layer.rpartition('.')[0]}.{GROUP_MODULES[group_key(kinds)]}"


def rotation_module(layer: str) -> str:
    """Module name of the online rotation feeding `layer`: …self_attn.rotate_qkv; rotate_lm_head."""
    if layer == HEAD:
        return ROTATION_MODULES["head"]
    return f"{layer.rpartition('.')[0]}.{ROTATION_MODULES[INPUT_GROUPS[parse_layer_name(layer)[1]]]}"


def layer_name(block: int, kind: str) -> str:
    part = "self_attn" if kind in ("q", "k", "v", "o") else "mlp"
    return f"model.layers.{block}.{part}.{kind}_proj"


def parse_layer_name(name: str, blocks: int | None = None) -> tuple[int, str]:
    """(block, kind) of a Llama-style linear layer name; ModelError otherwise. `lm_head` is block
    `blocks` (-1 when the block count is not known)."""
    if name == HEAD:
        return (-1 if blocks is None else blocks), "head"
    m = _NAME_RE.match(name)
    if not m:
        raise ModelError(
            f"layer name {name!r} is not a Llama-style projection "
            "(model.layers.N.self_attn.{q,k,v,o}_proj or model.layers.N.mlp.{gate,up,down}_proj)"
        )
    return int(m["block"]), m["kind"]


def load_config(path: str | Path) -> dict:
    """config.json of a local Hugging Face model directory (or the file itself)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        if p.is_dir():
            raise ModelError(f"{p} has no config.json; is it a Hugging Face model directory?")
        raise ModelError(f"model {str(path)!r}: no such directory or config.json file")
    cfg = read_json_object(f, "model config", ModelError)
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrapper
        cfg = cfg["text_config"]
    return cfg


def _get(cfg: dict, key: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or v <= 0:
        raise ModelError(f"config.json: {key!r} missing or not a positive integer ({v!r})")
    return v


#: a compressed checkpoint's model_type is its source's between these ("qpalette_llama.needs-import-qpalette"):
#: plain transformers refuses a type it does not know, where it would load random weights, and its
#: refusal prints the type, the one text of ours it shows: so the type says what to do (docs/format.md).
#: Checkpoints written before the suffix ("qpalette_llama") load too.
CHECKPOINT_TYPE_PREFIX = "qpalette_"
CHECKPOINT_TYPE_SUFFIX = ".needs-import-qpalette"


def checkpoint_model_type(base: str) -> str:
    """The model_type compress writes for a source of model_type `base`."""
    return CHECKPOINT_TYPE_PREFIX + base + CHECKPOINT_TYPE_SUFFIX


def base_model_type(cfg: dict):
    """The architecture's model_type: a compressed checkpoint's without what compress adds."""
    mt = cfg.get("model_type")
    return mt.removeprefix(CHECKPOINT_TYPE_PREFIX).removesuffix(CHECKPOINT_TYPE_SUFFIX) if isinstance(mt, str) else mt


def check_config(cfg: dict) -> None:
    mt = base_model_type(cfg)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model_type {mt!r} is not supported; qpalette knows {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(moe_key):
            raise ModelError(f"mixture-of-experts models ({moe_key}) are not supported")


def dims(cfg: dict) -> dict[str, int]:
    check_config(cfg)
    hidden = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return {
        "hidden": hidden,
        "intermediate": _get(cfg, "intermediate_size"),
        "heads": heads,
        "kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "blocks": _get(cfg, "num_hidden_layers"),
        "vocab": _get(cfg, "vocab_size"),
    }


def linear_layers(cfg: dict, lm_head: bool = False) -> list[LayerShape]:
    """Every quantizable linear layer, block by block in q, k, v, o, gate, up, down order; then
    lm_head when asked for."""
    d = dims(cfg)
    shapes = {
        "q": (d["heads"] * d["head_dim"], d["hidden"]),
        "k": (d["kv_heads"] * d["head_dim"], d["hidden"]),
        "v": (d["kv_heads"] * d["head_dim"], d["hidden"]),
        "o": (d["hidden"], d["heads"] * d["head_dim"]),
        "gate": (d["intermediate"], d["hidden"]),
        "up": (d["intermediate"], d["hidden"]),
        "down": (d["hidden"], d["intermediate"]),
    }
    layers = [
        LayerShape(layer_name(b, k), *shapes[k], b, k) for b in range(d["blocks"]) for k in BLOCK_KINDS
    ]
    if lm_head:
        layers.append(head_layer(cfg))
    return layers


def head_layer(cfg: dict) -> LayerShape:
    """lm_head as a layer: [vocab, hidden], block num_hidden_layers."""
    d = dims(cfg)
    return LayerShape(HEAD, d["vocab"], d["hidden"], d["blocks"], "head")


def unquantized_params(cfg: dict, lm_head_quantized: bool = False) -> dict[str, int]:
    """Parameter counts of what stays unquantized (per module kind, summed over blocks). A tied
    lm_head is the embedding: quantizing it leaves the embedding in 16 bits all the same."""
    d = dims(cfg)
    h, n = d["hidden"], d["blocks"]
    q_out, kv_out = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    out = {"embed_tokens": d["vocab"] * h}
    if not cfg.get("tie_word_embeddings", False) and not lm_head_quantized:
        out["lm_head"] = d["vocab"] * h
    out["norms"] = (2 * n + 1) * h
    if base_model_type(cfg) == "qwen3":
        out["qk_norms"] = 2 * n * d["head_dim"]
    attn_bias = cfg.get("attention_bias", base_model_type(cfg) == "qwen2")
    if attn_bias:
        out["attention_bias"] = n * (q_out + 2 * kv_out)
        if base_model_type(cfg) != "qwen2":  # Llama's attention_bias also covers o_proj
            out["attention_bias"] += n * h
    if cfg.get("mlp_bias"):
        out["mlp_bias"] = n * (2 * d["intermediate"] + h)
    return out


def layers_from_shapes(shapes: dict[str, tuple[int, int]]) -> list[LayerShape]:
    """LayerShapes from {name: [out, in]} (e.g. a sensitivity file), sorted by block and kind;
    lm_head, if there, last (block: one past the last block)."""
    blocks = 1 + max((parse_layer_name(n)[0] for n in shapes if n != HEAD), default=-1)
    layers = []
    for name, shape in shapes.items():
        b, k = parse_layer_name(name, blocks)
        if (
            not isinstance(shape, (list, tuple))
            or len(shape) != 2
            or not all(isinstance(x, int) and x > 0 for x in shape)
        ):
            raise ModelError(f"layer {name}: shape {shape!r} is not [out, in]")
        layers.append(LayerShape(name, shape[0], shape[1], b, k))
    layers.sort(key=lambda l: (l.block, KINDS.index(l.kind)))
    return layers


def sign_vector_bytes(layers: list[LayerShape]) -> int:
    """One bit-packed ±1 vector (in_features/8 bytes) per input group of each block."""
    seen: dict[tuple[int, str], int] = {}
    for l in layers:
        seen[(l.block, l.input_group)] = l.in_features
    return sum((n + 7) // 8 for n in seen.values())
