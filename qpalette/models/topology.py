"""The quantizable linear layers of a decoder model: names, shapes, kinds, input and fusion groups.

Layers are found by walking the model (built on the meta device from its config.json, experts of
MoE blocks split per expert: models/experts.py) and selected by include/ignore patterns
(`models/walk.py`); which layers share an input, and so one sign vector and one online rotation
(docs/method.md §1), is traced, not read from names. This module holds what every stage shares:
`LayerShape`, the kinds and group keys plans and latency profiles use, module naming, and the
parameter counts of what stays unquantized.

A layer's kind is its module's attribute name without `_proj` (`q`, `k`, `v`, `o`, `gate`, `up`,
`down`; Phi-3's pre-fused `qkv` and `gateup`; Mixtral's `w1`/`w3`/`w2` are `gate`/`up`/`down`).
The output projection `lm_head` is a layer too when asked for (`linear_layers(cfg, lm_head=True)`):
kind `head`, counted as block `num_hidden_layers` (after the last decoder block), its own input group.
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
#: the families tested end to end (tiny models of each config class): their compressed checkpoints'
#: `qpalette_<type>` is registered with transformers on `import qpalette`; any other decoder whose
#: blocks walk (models/walk.py) is tried too, its type registered when it is loaded
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                         "qwen3_moe", "qwen2_moe", "olmoe")
UNQUANTIZED_BYTES_PER_PARAM = 2  # embeddings, lm_head, norms, biases stay in fp16/bf16
#: module attribute names whose kind is not the name without `_proj`
KIND_ALIASES = {"gate_up": "gateup", "w1": "gate", "w3": "up", "w2": "down", "lm_head": "head"}

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(?P<block>\d+)\.")


def kind_of(name: str) -> str:
    """A layer's kind from its name: the attribute without `_proj` (`model.layers.0.self_attn.q_proj` → q)."""
    attr = name.rpartition(".")[2]
    return KIND_ALIASES.get(attr, KIND_ALIASES.get(attr.removesuffix("_proj"), attr.removesuffix("_proj")))


def group_key(kinds: list[str]) -> str:
    """The fusion group of these member kinds: 'qkv' for [q, k, v], 'gateup' for [gate, up]."""
    return "".join(kinds)


def rotation_name(parent: str, key: str) -> str:
    """Module name of the online rotation of input group `key` beside the layers it feeds under
    `parent` (…self_attn.rotate_qkv); lm_head's is `rotate_lm_head`."""
    if key == "head":
        return ROTATION_MODULES["head"]
    return f"{parent}.{ROTATION_MODULES.get(key, 'rotate_' + key)}"


@dataclass(frozen=True)
class LayerShape:
    """One quantizable layer. `input_group` names, unique within its block, the layers that read one
    input (one sign vector); `rotation` is the module holding that group's online rotation. Both
    come from the traced model (models/walk.py); given only a name, the kind's usual group."""

    name: str
    out_features: int
    in_features: int
    block: int
    kind: str
    input_group: str = ""
    rotation: str = ""

    def __post_init__(self):
        if not self.input_group:
            object.__setattr__(self, "input_group", INPUT_GROUPS.get(self.kind, self.kind))
        if not self.rotation:
            key = self.input_group.rpartition(".")[2]
            object.__setattr__(self, "rotation", rotation_name(self.parent, key))

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def parent(self) -> str:
        """The module holding the layer (…self_attn, …mlp.experts.3)."""
        return self.name.rpartition(".")[0]


def group_members(g: str, kinds) -> tuple[str, ...] | None:
    """The member kinds of group `g` among the layer kinds of one parent module: itself when a
    layer has that kind (Phi-3's pre-fused `qkv`), else GROUPS[g] when all are there; else None."""
    if g in kinds:
        return (g,)
    members = GROUPS.get(g)
    if members and len(members) > 1 and all(k in kinds for k in members):
        return members
    return None


def units(layers: list[LayerShape]) -> dict[int, dict[str, dict[str, int]]]:
    """block → parent module → kind → index into `layers` (one layer of each kind per parent):
    the units within which layers fuse."""
    out: dict[int, dict[str, dict[str, int]]] = {}
    for i, l in enumerate(layers):
        kinds = out.setdefault(l.block, {}).setdefault(l.parent, {})
        if l.kind in kinds:
            raise ModelError(f"two layers of kind {l.kind} under {l.parent}")
        kinds[l.kind] = i
    return out


def group_module(layer: str, kinds: list[str]) -> str:
    """Module name of the fused group of `kinds` beside `layer`: …self_attn.qkv_proj."""
    return f"{layer.rpartition('.')[0]}.{GROUP_MODULES[group_key(kinds)]}"


def layer_name(block: int, kind: str) -> str:
    """The Llama-style name of a layer of `kind` in `block`."""
    part = "self_attn" if kind in ("q", "k", "v", "o") else "mlp"
    return f"model.layers.{block}.{part}.{kind}_proj"


def parse_layer_name(name: str, blocks: int | None = None) -> tuple[int, str]:
    """(block, kind) of a layer name (`model.layers.N.….X_proj`); ModelError otherwise. `lm_head`
    is block `blocks` (-1 when the block count is not known)."""
    if name == HEAD:
        return (-1 if blocks is None else blocks), "head"
    m = _BLOCK_RE.search(name)
    if not m or name.endswith("."):
        raise ModelError(f"layer name {name!r} is not a decoder-block layer (model.layers.N.…)")
    return int(m["block"]), kind_of(name)


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
    """Refuse a model whose layers cannot be found: the one line names the layer or block layout
    that is not understood (models/walk.py)."""
    from qpalette.models.walk import walk

    walk(cfg)


def dims(cfg: dict) -> dict[str, int]:
    """The config's main sizes (they identify a model's shapes in Hessian fingerprints)."""
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


def linear_layers(cfg: dict, lm_head: bool = False, targets: list[str] | None = None,
                  ignore: list[str] | None = None) -> list[LayerShape]:
    """Every quantizable linear layer of the decoder blocks, block by block in module order (q, k,
    v, o, gate, up, down for Llama), chosen by `targets`/`ignore` (regular expressions on layer
    names; models/walk.py has the defaults); then lm_head when asked for."""
    from qpalette.models.walk import walk

    layers = list(walk(cfg).select(targets, ignore))
    if lm_head:
        layers.append(head_layer(cfg))
    return layers


def head_layer(cfg: dict) -> LayerShape:
    """lm_head as a layer: [vocab, hidden], block num_hidden_layers."""
    from qpalette.models.walk import walk

    return walk(cfg).head


def rotation_modules(cfg: dict) -> dict[str, str]:
    """Layer name → the module of its online rotation, for every linear layer and lm_head."""
    from qpalette.models.walk import walk

    w = walk(cfg)
    return {l.name: l.rotation for l in w.layers + (w.head,)}


def unquantized_params(cfg: dict, lm_head_quantized: bool = False, targets: list[str] | None = None,
                       ignore: list[str] | None = None) -> dict[str, int]:
    """Parameter counts of what stays unquantized (per category, summed over blocks). A tied
    lm_head is the embedding: quantizing it leaves the embedding in 16 bits all the same."""
    from qpalette.models.walk import walk

    out = walk(cfg).unquantized(set(l.name for l in linear_layers(cfg, False, targets, ignore)))
    if lm_head_quantized:
        out.pop("lm_head", None)
    return out


def layers_from_shapes(shapes: dict[str, tuple[int, int]]) -> list[LayerShape]:
    """LayerShapes from {name: [out, in]} (e.g. a sensitivity file) in the file's order within
    each block (the model's order), by block; lm_head, if there, last (block: one past the last
    block). Input groups are the kinds' usual ones: no model to trace."""
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
    layers.sort(key=lambda l: (l.block, KINDS.index(l.kind) if l.kind in KINDS else len(KINDS)))
    return layers


def sign_vector_bytes(layers: list[LayerShape]) -> int:
    """One bit-packed ±1 vector (in_features/8 bytes) per input group of each block."""
    seen: dict[tuple[int, str], int] = {}
    for l in layers:
        seen[(l.block, l.input_group)] = l.in_features
    return sum((n + 7) // 8 for n in seen.values())
