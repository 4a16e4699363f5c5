"""A damaged compressed checkpoint or plan is refused with a clear error, never a traceback, a
hang or a model with random weights: bytes flipped in / files truncated or deleted, for each kind
of file a checkpoint holds (shards, index, config's quantization_config, codebooks) and for plans."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from helpers import run_compress
from typer.testing import CliRunner

import qpalette
from qpalette.cli import app
from qpalette.errors import QpaletteError

runner = CliRunner()


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corrupt") / "q"
    run_compress(tiny_llama_dir, out, scheme="nuq-4")
    return out


@pytest.fixture
def ckpt(good, tmp_path) -> Path:
    dst = tmp_path / "q"
    shutil.copytree(good, dst)
    return dst


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def header_len(f: Path) -> int:
    return struct.unpack("<Q", f.read_bytes()[:8])[0]


def flip(f: Path, offset: int) -> None:
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x5A
    f.write_bytes(bytes(data))


def refused(d: Path, match: str) -> None:
    """The library and the CLI both refuse d with a message matching `match` (a regex)."""
    with pytest.raises(QpaletteError, match=match or None):
        qpalette.from_pretrained(d, device="cpu")
    res = runner.invoke(app, ["eval", str(d), "--text-file", str(d / "config.json"), "--ctx", "32"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output


def test_the_pristine_checkpoint_loads(ckpt):
    qpalette.from_pretrained(ckpt, device="cpu")


@pytest.mark.parametrize("which", [0, -1])  # a decoder block's shard; the last (embeddings, codebooks)
@pytest.mark.parametrize("where", ["data_start", "data_end", "header"])
def test_flipped_byte_in_a_shard(ckpt, which, where):
    f = shards(ckpt)[which]
    n, size = header_len(f), f.stat().st_size
    offset = {"data_start": 8 + n, "data_end": size - 1, "header": 8 + n // 2}[where]
    flip(f, offset)
    refused(ckpt, f.name)


def test_truncated_and_deleted_shards(ckpt):
    f = shards(ckpt)[1]
    f.write_bytes(f.read_bytes()[:-100])
    refused(ckpt, f.name)
    f.unlink()
    refused(ckpt, "")


@pytest.mark.parametrize("damage", ["delete", "garbage", "missing_shard"])
def test_index(ckpt, damage):
    idx = ckpt / "model.safetensors.index.json"
    if damage == "delete":
        idx.unlink()
    elif damage == "garbage":
        idx.write_text("{not json")
    else:
        doc = json.loads(idx.read_text())
        doc["weight_map"][next(iter(doc["weight_map"]))] = "model-00009-of-00009.safetensors"
        idx.write_text(json.dumps(doc))
    refused(ckpt, "index" if damage != "delete" else "")


def test_tensor_left_out_of_the_index_still_loads_whole(ckpt, good):
    """transformers reads every tensor of the shards the index names: a name dropped from the
    index loses nothing (the model computes exactly what the pristine one does)."""
    import torch

    idx = ckpt / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"].pop(next(k for k in doc["weight_map"] if k.endswith(".codes")))
    idx.write_text(json.dumps(doc))
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        got = qpalette.from_pretrained(ckpt, device="cpu")(ids).logits
        want = qpalette.from_pretrained(good, device="cpu")(ids).logits
    assert torch.equal(got, want)


def test_tensor_missing_from_the_shards(ckpt):
    """A shard without one of the tensors the quantization_config implies is refused by name."""
    from safetensors.torch import load_file, save_file

    f = shards(ckpt)[0]
    tensors = load_file(str(f))
    gone = next(k for k in tensors if k.endswith(".row_scale"))
    del tensors[gone]
    save_file(tensors, str(f), metadata={"format": "pt"})
    idx = ckpt / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"].pop(gone)
    idx.write_text(json.dumps(doc))
    refused(ckpt, re.escape(gone))


@pytest.mark.parametrize("edit", [
    lambda qc: qc.update(format="qpalette.checkpoint/0"),
    lambda qc: qc.update(layers="nuq-4"),
    lambda qc: qc["layers"].update({next(iter(qc["layers"])): "nuq-99"}),
    lambda qc: qc["layers"].update({"model.layers.0.self_attn.nope_proj": "nuq-4"}),
    lambda qc: qc["layers"].update({next(iter(qc["layers"])): "nuq-3"}),  # codes of another size
    lambda qc: qc["groups"].update({"model.layers.0.self_attn.qkv_proj": ["model.layers.0.self_attn.q_proj"]}),
    lambda qc: qc.update(sign_seed="x"),
], ids=["format", "layers_not_a_map", "unknown_entry", "unknown_layer", "other_entry", "bad_group", "seed"])
def test_quantization_config(ckpt, edit):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg["quantization_config"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    refused(ckpt, "")


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "llama", ')
    refused(ckpt, "")


def test_codebook_changed_in_a_resaved_shard(ckpt):
    """A codebook edited in a shard that carries no checksum (re-saved elsewhere) is still caught."""
    from safetensors.torch import load_file, save_file

    last = shards(ckpt)[-1]
    tensors = load_file(str(last))
    name = next(k for k in tensors if k.startswith("qpalette_codebooks."))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(last), metadata={"format": "pt"})
    refused(ckpt, "codebooks")


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_plan(tiny_llama_dir, tmp_path, damage):
    from helpers import fake_sensitivity

    sens = fake_sensitivity(tiny_llama_dir, tmp_path / "sens.json")
    plan = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", str(tiny_llama_dir), "-b", "3.0bits", "-s", str(sens), "-p", "nuq",
                              "-o", str(plan), "--no-plot"])
    assert res.exit_code == 0, res.output
    text = plan.read_text()
    plan.write_text({"truncate": text[: len(text) // 2], "empty": "",
                     "flip": text.replace('"quantizer": "nuq-', '"quantizer": "nuq-9', 1)}[damage])
    res = runner.invoke(app, ["compress", str(tiny_llama_dir), "--plan", str(plan), "-o", str(tmp_path / "q"), "-q"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "plan" in res.output
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])
def test_nan_or_inf_in_the_source_is_named(tmp_path, bad, tensor):
    """A NaN/Inf in any weight of the model being compressed stops compress with one line naming
    the tensor; nothing is left that looks like a checkpoint."""
    from safetensors.torch import load_file, save_file
    from tiny_llama import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src")
    f = src / "model.safetensors"
    tensors = load_file(str(f))
    tensors[tensor].view(-1)[3] = bad
    save_file(tensors, str(f), metadata={"format": "pt"})
    res = runner.invoke(app, ["compress", str(src), "--scheme", "nuq-4", "-o", str(tmp_path / "q"), "-q"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert tensor in res.output and "NaN/Inf" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()
