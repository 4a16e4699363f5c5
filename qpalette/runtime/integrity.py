"""Checks that a compressed checkpoint is the one compress wrote, before any of it is used.

Compress writes each shard with two sha256 digests in its safetensors metadata: of the data bytes
and of the header's tensor table (names, dtypes, shapes, offsets). Loading (`verify_checkpoint_
files`, also the transformers hook through `verify_shard`) re-reads them, so a flipped byte
anywhere in a shard is reported with the file's name; and it compares the tensor table with what
the `quantization_config` implies (every code, scale, sign and codebook tensor present with the
shape and dtype the kernels will index by), so a hand-edited config or index cannot make a layer
run on missing or mis-sized buffers. Shards re-saved by transformers' `save_pretrained` carry no
digests: for them only sizes and the tensor table are checked.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from qpalette.errors import CheckpointError, ModelError

DATA_HASH_KEY = "qpalette_data_sha256"
TABLE_HASH_KEY = "qpalette_header_sha256"
_SAFETENSORS_DTYPES = {torch.int32: "I32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
                       torch.int16: "I16", torch.float32: "F32", torch.int64: "I64", torch.int8: "I8"}
_VERIFIED: set[tuple[str, int, int]] = set()
_REDO = "re-run `qpalette compress` (or copy the file again)"


def _table_digest(header: dict) -> str:
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()


def shard_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file whose metadata records the sha256 of its data bytes and of its tensor table.
    The header is re-serialised here with the metadata keys in a fixed order (safetensors writes a
    metadata map in hash order, which differs between runs: resumed shards must be byte-identical),
    space-padded to 8 bytes as safetensors pads it."""
    from safetensors.torch import save

    plain = save(tensors, metadata={"format": "pt"})
    (n,) = struct.unpack("<Q", plain[:8])
    table = {k: v for k, v in json.loads(plain[8:8 + n]).items() if k != "__metadata__"}
    data = memoryview(plain)[8 + n:]
    meta = {"format": "pt", DATA_HASH_KEY: hashlib.sha256(data).hexdigest(), TABLE_HASH_KEY: _table_digest(table)}
    text = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def read_header(p: Path) -> dict:
    """The header of a safetensors file (its tensor table and metadata); CheckpointError naming the
    file when it is truncated or not a well-formed table."""
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{p}: truncated ({size} bytes): not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{p}: truncated or damaged header (says {n} bytes, file has {size})")
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__" and not (isinstance(v["dtype"], str) and all(isinstance(x, int) for x in v["shape"])
                                            and len(v["data_offsets"]) == 2):
                raise ValueError(f"entry {k!r}")
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except OSError as e:
        raise CheckpointError(f"cannot read {p}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError,
            ValueError) as e:
        raise CheckpointError(f"{p}: damaged safetensors header ({type(e).__name__}: {e}); {_REDO}") from None
    if 8 + n + max(ends, default=0) != size:
        raise CheckpointError(
            f"{p}: truncated or damaged: header describes {8 + n + max(ends, default=0)} bytes, the file "
            f"has {size}; {_REDO}"
        )
    return header


def verify_shard(path: str | Path) -> dict:
    """Refuse a safetensors file that is truncated, padded, has a damaged header, or whose data or
    tensor table differ from the digests compress recorded, naming it; returns its header. A file
    verified once (same path, size and mtime) is not hashed again in this process."""
    p = Path(path)
    header = read_header(p)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key in _VERIFIED:
        return header
    meta = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else {}
    if meta.get(TABLE_HASH_KEY) and meta[TABLE_HASH_KEY] != _table_digest(header):
        raise CheckpointError(f"{p}: damaged: its tensor table does not match the checksum compress recorded; {_REDO}")
    if meta.get(DATA_HASH_KEY):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            f.seek(8 + struct.unpack("<Q", f.read(8))[0])
            while chunk := f.read(1 << 24):
                h.update(chunk)
        if h.hexdigest() != meta[DATA_HASH_KEY]:
            raise CheckpointError(f"{p}: damaged: its tensor bytes do not match the checksum compress recorded; {_REDO}")
    _VERIFIED.add(key)
    return header


def verify_checkpoint_files(folder: str | Path) -> None:
    """Every shard a compressed checkpoint folder names exists and passes `verify_shard`, and the
    tensors the quantization_config implies are all there with their shapes and dtypes. Run before
    transformers opens the files, so that damage is reported by file and tensor."""
    d = Path(folder)
    tables: dict[str, tuple[str, dict]] = {}
    for f in _shard_files(d):
        for name, entry in verify_shard(d / f).items():
            if name != "__metadata__":
                tables[name] = (f, entry)
    expected = expected_tensors(json.loads((d / "config.json").read_text()))
    for name, (shape, dtype) in expected.items():
        if name not in tables:
            raise CheckpointError(f"{d}: tensor {name} is missing from the shards; {_REDO}")
        f, entry = tables[name]
        if list(entry["shape"]) != list(shape) or entry["dtype"] != _SAFETENSORS_DTYPES.get(dtype, "?"):
            raise CheckpointError(
                f"{d / f}: tensor {name} is {entry['dtype']} {entry['shape']}, the quantization_config "
                f"implies {_SAFETENSORS_DTYPES.get(dtype, dtype)} {list(shape)}; {_REDO}"
            )


def _shard_files(d: Path) -> list[str]:
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no safetensors shards and no model.safetensors.index.json")
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: damaged ({type(e).__name__}: {e}); {_REDO}") from None
    missing = [f for f in files if not (d / f).is_file()]
    if missing:
        raise CheckpointError(f"{d}: shard(s) {', '.join(missing[:3])} named in the index are missing; {_REDO}")
    return files


def expected_tensors(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (shape, dtype) of every tensor the quantization_config of `cfg` implies: each
    quantized module's stored tensors, each rotation's signs, each codebook."""
    from qpalette.models.topology import linear_layers
    from qpalette.quant.codebooks import codebook
    from qpalette.quant.palette import get_quantizer
    from qpalette.runtime.checkpoint import CODEBOOKS_MODULE, Layout
    from qpalette.runtime.modules import buffer_name

    layout = Layout.from_config(cfg.get("quantization_config") or {})
    try:
        layers = {l.name: l for l in linear_layers(cfg, lm_head=True, targets=[".*"], ignore=[])}
    except ModelError as e:
        raise CheckpointError(f"config.json: {e}") from None
    shapes = {n: (l.out_features, l.in_features) for n, l in layers.items()}
    unknown = sorted(set(layout.layers) - set(shapes))
    if unknown:
        raise CheckpointError(f"quantization_config names layers the model does not have: {unknown[:3]}")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    modules = {g: ms for g, ms in layout.groups.items()} | {n: [n] for n in layout.layers if not layout.group_of(n)}
    for module, members in modules.items():
        rows, cols = sum(shapes[m][0] for m in members), shapes[members[0]][1]
        for t, (shape, dtype) in get_quantizer(layout.layers[members[0]]).tensor_specs(rows, cols).items():
            out[f"{module}.{t}"] = (tuple(shape), dtype)
        out[f"{layers[members[0]].rotation}.signs"] = ((cols // 8,), torch.uint8)
    for cb in layout.codebooks:
        out[f"{CODEBOOKS_MODULE}.{buffer_name(cb)}"] = (tuple(codebook(cb).shape), torch.float16)
    return out
