"""The Hessian folder written by `qpalette hessians` and read by `compress --hessians`
(`qpalette.hessians/1`, docs/format.md).

One safetensors file per decoder block (`block-00007.safetensors`) and one for lm_head's input
(`head.safetensors`), each holding H = XᵀX / n (float32, in × in) of every input group of that
block (`qkv`, `o`, `gateup`, `down`; `head`), with the run's settings and the groups' layers and
token counts in its header (metadata key `qpalette.hessians`, JSON); `hessians.json`, written
last, lists the files with their sha256.
A folder without it is unfinished (`--resume` completes it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from qpalette.errors import InputError, ModelError
from qpalette.fileio import atomic_write, read_json_object
from qpalette.models.topology import LayerShape, dims, linear_layers

FORMAT = "qpalette.hessians/1"
MANIFEST = "hessians.json"
HEAD_FILE = "head.safetensors"
HEADER_KEY = "qpalette.hessians"  # the safetensors metadata key holding a file's header (JSON)


def block_file(block: int, blocks: int) -> str:
    """File of decoder block `block`; block == blocks is lm_head's."""
    return HEAD_FILE if block == blocks else f"block-{block:05d}.safetensors"


def input_groups(layers: list[LayerShape]) -> dict[int, dict[str, list[LayerShape]]]:
    """block → input group → the layers reading that input, in model order."""
    out: dict[int, dict[str, list[LayerShape]]] = {}
    for l in layers:
        out.setdefault(l.block, {}).setdefault(l.input_group, []).append(l)
    return out


def model_fingerprint(src, cfg: dict) -> str:
    """What identifies a model for its Hessians: its shapes and the float32 values of its first
    and last block layers (q_proj of block 0 and the last down_proj for Llama; a fine-tune of the
    same shapes differs; a bf16 and a float32 copy of the same weights do not)."""
    h = hashlib.sha256(json.dumps(dims(cfg), sort_keys=True).encode())
    layers = linear_layers(cfg, targets=[".*"], ignore=[])
    for name in (f"{layers[0].name}.weight", f"{layers[-1].name}.weight"):
        if name not in src.files:
            raise ModelError(f"{src.folder}: {name} is missing from the checkpoint")
        h.update(src.get(name).float().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def write_file(path: Path, hessians: dict[str, torch.Tensor], header: dict) -> str:
    """Write one file atomically, `header` (format, model, tokens, run, block, groups) as its
    metadata; returns its sha256. One metadata key: safetensors writes several in hash order, and a
    resumed run must write the same bytes."""
    meta = {HEADER_KEY: json.dumps(header, sort_keys=True)}
    data = save_bytes({k: v.contiguous().cpu() for k, v in hessians.items()}, metadata=meta)
    atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


def file_header(path: Path) -> dict | None:
    """A finished file's header, or None if it is not one of ours."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get(HEADER_KEY, "{}"))
    except (SafetensorError, OSError, json.JSONDecodeError):
        return None
    return header if header.get("format") == FORMAT else None


class HessianSet:
    """A finished Hessian folder, checked against the model before compress uses it."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError(f"--hessians {self.folder}: no such folder")
        if not (self.folder / MANIFEST).is_file():
            raise InputError(f"--hessians {self.folder} has no {MANIFEST}: not a finished `qpalette "
                             "hessians` run (finish it with the same command and --resume)")
        self.manifest = read_json_object(self.folder / MANIFEST, "Hessian manifest", InputError, FORMAT,
                                         "written by `qpalette hessians`")
        self.digest = hashlib.sha256((self.folder / MANIFEST).read_bytes()).hexdigest()

    def check(self, fingerprint: str, layers: list[LayerShape], blocks: int) -> None:
        """Refuse Hessians of another model, or that lack a layer to quantize."""
        m, where = self.manifest, f"--hessians {self.folder}"
        if m.get("model_fingerprint") != fingerprint or m.get("blocks") != blocks:
            raise InputError(f"{where} was collected on another model ({m.get('model')!r}, {m.get('blocks')} "
                             "blocks); collect them for this one with `qpalette hessians MODEL ...`")
        for l in layers:
            file = m.get("files", {}).get(block_file(l.block, blocks), {})
            info = file.get("groups", {}).get(l.input_group) or {}
            if l.name not in info.get("layers", []) or info.get("in_features") != l.in_features:
                raise InputError(f"{where} has no Hessian of {l.name}'s input ({l.in_features} features); "
                                 "it does not match this model")

    def load(self, block: int) -> dict[str, torch.Tensor]:
        """Input group → H of block `block` (lm_head's when block == blocks), its digest checked."""
        name = block_file(block, self.manifest["blocks"])
        path = self.folder / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror or e}") from None
        if hashlib.sha256(data).hexdigest() != self.manifest["files"][name]["sha256"]:
            raise InputError(f"{path} is damaged (its sha256 differs from {MANIFEST}'s); collect the "
                             "Hessians again")
        out = load_bytes(data)
        for group, h in out.items():
            if h.ndim != 2 or h.shape[0] != h.shape[1] or not bool(torch.isfinite(h).all()):
                raise InputError(f"{path}: {group} is not a finite square matrix; collect the Hessians again")
        return out

    def provenance(self) -> dict:
        """What a data-aware checkpoint records about the Hessians it used."""
        m = self.manifest
        keep = ("model", "source", "text_sha256", "tokens", "num_seqs", "seq_len")
        return {"path": str(self.folder.resolve()), "manifest_sha256": self.digest,
                **{k: m.get(k) for k in keep}}
