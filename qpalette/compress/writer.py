"""`qpalette compress`: stream a checkpoint block by block into a qpalette checkpoint.

Per decoder block: read its tensors from the source safetensors, rotate each input group's
layers with one seeded sign vector, quantize every layer (a fused group as one row-concatenated
matrix), write the block's shard. Everything goes into `OUT.partial/`, each file written
atomically, with a progress manifest after every shard; the folder is renamed to OUT only when
config.json, the index, tokenizer and model card are all written. So a killed run leaves no
folder that looks complete, and `--resume` picks up at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from qpalette.devices import resolve_device
from qpalette.errors import CompressError, UnknownQuantizer, UnsupportedShape
from qpalette.fileio import atomic_write, atomic_write_json, read_json_object
from qpalette.models.topology import (
    LayerShape,
    check_config,
    group_module,
    linear_layers,
    load_config,
)
from qpalette.quant.codebooks import codebook
from qpalette.quant.hadamard import decompose
from qpalette.quant.incoherence import pack_signs, random_signs, rotate_weight
from qpalette.quant.palette import get_quantizer
from qpalette.runtime.checkpoint import (
    CODEBOOKS_MODULE,
    Layout,
    parent_and_attr,
    sign_seed,
)
from qpalette.runtime.modules import buffer_name
from qpalette.version import __version__

PROGRESS_FORMAT = "qpalette.compress-progress/1"
PLAN_FORMAT = "qpalette.plan/1"
PROGRESS_FILE = "qpalette-progress.json"
REPORT_FILE = "qpalette-compress.json"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "README.md", PROGRESS_FILE}


class StopAfterShard(Exception):
    """Raised by tests (via `stop_after`) to simulate a run killed between shards."""


@dataclass
class CompressOptions:
    model: str
    output: Path
    plan: Path | None = None
    scheme: str | None = None
    fuse: bool = True
    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    sign_seed: int = 0
    quiet: bool = False
    stop_after: int | None = None  # tests: stop after this many shards written in this run
    random_codes: bool = False  # speed benchmarks of random-weight models: skip the quantizer
    extra: dict = field(default_factory=dict)


# --- what to quantize ------------------------------------------------------------------------

def layout_from_scheme(scheme: str, layers: list[LayerShape], fuse: bool, seed: int) -> Layout:
    q = get_quantizer(scheme).name
    groups: dict[str, list[str]] = {}
    if fuse:
        by_parent: dict[tuple[int, str], list[LayerShape]] = {}
        for l in layers:
            if l.input_group in ("qkv", "gateup"):
                by_parent.setdefault((l.block, l.input_group), []).append(l)
        for members in by_parent.values():
            names = [m.name for m in members]
            gname = group_module(names[0], [m.kind for m in members])
            groups[gname] = names
    return Layout({l.name: q for l in layers}, groups, seed)


def layout_from_plan(path: Path, layers: list[LayerShape], fuse: bool, seed: int) -> tuple[Layout, dict]:
    plan = read_json_object(path, "plan", CompressError, PLAN_FORMAT, "written by `qpalette plan -o`")
    planned = plan.get("layers")
    if not isinstance(planned, dict):
        raise CompressError(f"plan {path} has no 'layers' object")
    known = {l.name: l for l in layers}
    extra = sorted(set(planned) - set(known))
    missing = sorted(set(known) - set(planned))
    if extra or missing:
        raise CompressError(
            f"plan {path} does not match the model: "
            + (f"layers not in the model: {extra[:3]}{'…' if len(extra) > 3 else ''}; " if extra else "")
            + (f"model layers missing from the plan: {missing[:3]}{'…' if len(missing) > 3 else ''}" if missing else "")
        )
    chosen = {}
    for name, entry in planned.items():
        l = known[name]
        if list(entry.get("shape", [])) != [l.out_features, l.in_features]:
            raise CompressError(
                f"plan {path}: {name} has shape {entry.get('shape')} but the model's is "
                f"[{l.out_features}, {l.in_features}]; the plan was made for another model"
            )
        chosen[name] = entry.get("quantizer")
    groups: dict[str, list[str]] = {}
    if fuse:
        for blk in plan.get("blocks", []):
            for g in blk.get("groups", []):
                names = list(g.get("layers", []))
                if len(names) > 1:
                    kinds = [known[n].kind for n in names]
                    groups[group_module(names[0], kinds)] = names
    try:
        return Layout(chosen, groups, seed), plan
    except (UnknownQuantizer, ValueError, KeyError) as e:
        raise CompressError(f"plan {path}: {e}") from None


def check_shapes(layout: Layout, layers: list[LayerShape]) -> None:
    """Every layer's shape must fit its quantizer's packed format and the Hadamard sizes."""
    problems = []
    for l in layers:
        try:
            get_quantizer(layout.layers[l.name]).check_shape(l.out_features, l.in_features)
            decompose(l.in_features)
        except (UnsupportedShape, UnsupportedShape) as e:
            problems.append(f"{l.name} ({layout.layers[l.name]}): {e}")
    if problems:
        raise CompressError("unsupported layer shapes:\n  " + "\n  ".join(problems[:10]))


# --- reading the source --------------------------------------------------------------------

class SourceCheckpoint:
    """Tensor name → safetensors file of a Hugging Face model folder (single or sharded)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            data = read_json_object(index, "safetensors index", CompressError)
            self.files = {k: folder / v for k, v in data.get("weight_map", {}).items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                if any(folder.glob("*.bin")):
                    raise CompressError(
                        f"{folder} holds only PyTorch .bin (pickle) weights; qpalette reads "
                        "safetensors only: convert with `model.save_pretrained(dir)` first"
                    )
                raise CompressError(f"{folder} has no .safetensors weights")
            self.files = {}
            for f in files:
                for k in self._open(f).keys():
                    self.files[k] = f
        self._handles: dict[Path, object] = {}

    def _open(self, f: Path):
        try:
            return safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CompressError(f"cannot read {f}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = self._open(f)
        try:
            return self._handles[f].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CompressError(f"cannot read tensor {name} from {f}: {e}") from None

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in sorted(set(self.files.values())):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
        return h.hexdigest()[:16]


# --- quantizing one block ------------------------------------------------------------------

def half_dtype(cfg: dict) -> torch.dtype:
    """16-bit dtype of everything left unquantized: the source's bf16, else fp16."""
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "")
    return torch.bfloat16 if "bfloat16" in name else torch.float16


def quantize_matrix(w: torch.Tensor, quantizer: str, signs: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """Rotate (W·diag(s)·Hᵀ) and quantize one matrix; the stored tensors on CPU."""
    q = get_quantizer(quantizer)
    qm = q.quantize(rotate_weight(w.to(device, torch.float32), signs.to(device)))
    return {k: v.cpu() for k, v in qm.tensors.items()}


def quantize_block(src: SourceCheckpoint, block: int, layers: list[LayerShape], layout: Layout,
                   device, half: torch.dtype, on_layer: Callable[[str], None] = lambda n: None,
                   random_codes: bool = False) -> dict[str, torch.Tensor]:
    """All stored tensors of one decoder block."""
    prefix = f"model.layers.{block}."
    mine = [l for l in layers if l.block == block]
    out: dict[str, torch.Tensor] = {}
    signs: dict[str, torch.Tensor] = {}
    for l in mine:
        if l.input_group not in signs:
            signs[l.input_group] = random_signs(l.in_features, sign_seed(layout.sign_seed, block, l.input_group))
            out[f"{layout.rotation_of(l.name)}.signs"] = pack_signs(signs[l.input_group])
    done: set[str] = set()
    for l in mine:
        if l.name in done:
            continue
        gname = layout.group_of(l.name)
        members = layout.groups[gname] if gname else [l.name]
        on_layer(gname or l.name)
        w = torch.cat([src.get(f"{m}.weight").float() for m in members])
        target = gname or l.name
        if random_codes:
            q = get_quantizer(layout.layers[l.name])
            rms = w.float().pow(2).mean(1).sqrt() / q.row_target()
            gen = torch.Generator().manual_seed(block * 16 + len(done))
            tensors = q.random_tensors(*w.shape, gen, row_scale=rms)
        else:
            tensors = quantize_matrix(w, layout.layers[l.name], signs[l.input_group], device)
        for k, v in tensors.items():
            out[f"{target}.{k}"] = v
        biases = [f"{m}.bias" for m in members if f"{m}.bias" in src.files]
        if biases:
            out[f"{target}.bias"] = torch.cat([src.get(b) for b in biases]).to(half)
        done |= set(members)
    quantized = {f"{l.name}.{s}" for l in mine for s in ("weight", "bias")}
    for name in src.files:
        if name.startswith(prefix) and name not in quantized:
            t = src.get(name)
            out[name] = t.to(half) if t.is_floating_point() else t
    return out


def other_tensors(src: SourceCheckpoint, cfg: dict, layout: Layout, half: torch.dtype) -> dict[str, torch.Tensor]:
    """Embeddings, final norm, lm_head (unless tied) in 16-bit, and the codebooks (fp16)."""
    out = {}
    for name in src.files:
        if name.startswith("model.layers."):
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            continue
        t = src.get(name)
        out[name] = t.to(half) if t.is_floating_point() else t
    for cb in layout.codebooks:
        out[f"{CODEBOOKS_MODULE}.{buffer_name(cb)}"] = codebook(cb).to(torch.float16)
    return out


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def byte_breakdown(shard_tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, int]:
    """Bytes by the plan's accounting categories (docs/format.md)."""
    quantized_modules = set(layout.groups) | {n for n in layout.layers if not layout.group_of(n)}
    cats = {"codes_and_row_scales": 0, "sign_vectors": 0, "codebooks": 0, "unquantized_modules": 0}
    for name, t in shard_tensors.items():
        module, attr = parent_and_attr(name)
        n = t.numel() * t.element_size()
        if name.startswith(CODEBOOKS_MODULE + "."):
            cats["codebooks"] += n
        elif attr == "signs":
            cats["sign_vectors"] += n
        elif module in quantized_modules and attr != "bias":
            cats["codes_and_row_scales"] += n
        else:
            cats["unquantized_modules"] += n
    cats["total"] = sum(cats.values())
    return cats


# --- the run -------------------------------------------------------------------------------

def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def model_card(layout: Layout, source: str, report: dict) -> str:
    counts: dict[str, int] = {}
    for q in layout.layers.values():
        counts[q] = counts.get(q, 0) + 1
    mix = ", ".join(f"{q} ×{n}" for q, n in sorted(counts.items()))
    by = report["bytes"]
    return f"""---
library_name: transformers
tags: [qpalette, quantized]
---
# {Path(source).name} — qpalette compressed

**This checkpoint needs `import qpalette` before loading.** Without it, transformers does not
know `quant_method: "qpalette"`, skips the quantization with a warning and fills every linear
layer with random weights: the model loads but produces garbage.

```python
import qpalette  # registers the qpalette quantizer with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from qpalette.errors import CompressError, ModelError, UnknownQuantizer, UnsupportedShape

model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
# or: model = qpalette.from_pretrained("path/to/this/folder")  (picks device and dtype)
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```

- Source: `{source}`
- Quantized linear layers: {len(layout.layers)} ({mix}); fused groups: {len(layout.groups)}
- Average bits (quantized layers, nominal): {report['avg_bits']:.3f}
- Tensor bytes: {by['total']:,} (codes + row scales {by['codes_and_row_scales']:,}, sign vectors
  {by['sign_vectors']:,}, codebooks {by['codebooks']:,}, unquantized modules {by['unquantized_modules']:,})
- Written by qpalette {__version__}; format `qpalette.checkpoint/1` (see qpalette's docs/format.md).
{"- **Random code words (`--random-codes`): for speed measurements only, the outputs are noise.**" if report.get("random_codes") else ""}
"""


def compress(opts: CompressOptions, log: Callable[[str], None] = print) -> dict:
    """Run the whole compression; returns the report (also written to OUT/qpalette-compress.json)."""
    from tqdm.auto import tqdm

    from qpalette.models.sources import ModelError, resolve_model

    t0 = time.time()
    if (opts.plan is None) == (opts.scheme is None):
        raise CompressError("give exactly one of --plan PLAN.json or --scheme ENTRY (e.g. tcq-3.0)")
    try:
        src_dir = resolve_model(opts.model, quiet=opts.quiet)
        cfg = load_config(src_dir)
        check_config(cfg)
        layers = linear_layers(cfg)
    except (ModelError, ModelError) as e:
        raise CompressError(str(e)) from None
    try:
        if opts.scheme:
            layout = layout_from_scheme(opts.scheme, layers, opts.fuse, opts.sign_seed)
            plan = None
        else:
            layout, plan = layout_from_plan(opts.plan, layers, opts.fuse, opts.sign_seed)
    except UnknownQuantizer as e:
        raise CompressError(str(e)) from None
    check_shapes(layout, layers)
    device = resolve_device(opts.device)
    src = SourceCheckpoint(src_dir)
    missing = [f"{l.name}.weight" for l in layers if f"{l.name}.weight" not in src.files]
    if missing:
        raise CompressError(f"{src_dir}: weights missing from the checkpoint: {missing[:3]}")

    out = Path(opts.output)
    partial = out.with_name(out.name + ".partial")
    if out.exists() and any(out.iterdir()):
        if not opts.overwrite:
            raise CompressError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    blocks = cfg["num_hidden_layers"]
    n_shards = blocks + 1
    fingerprint = hashlib.sha256(json.dumps(
        {"layout": layout.to_config(), "source": src.fingerprint(), "device": device.type,
         "version": __version__, "random_codes": opts.random_codes}, sort_keys=True).encode()).hexdigest()[:16]
    manifest_path = partial / PROGRESS_FILE
    done: dict[str, dict] = {}
    prior_s = 0.0
    if partial.exists():
        if not opts.resume:
            raise CompressError(
                f"{partial} holds a previous unfinished run; continue it with --resume or delete it"
            )
        man = read_json_object(manifest_path, "compress progress", CompressError, PROGRESS_FORMAT)
        if man.get("fingerprint") != fingerprint:
            raise CompressError(
                f"{partial} was started with other settings (model, plan/scheme, seed, device or "
                "qpalette version differ); delete it or run with the same settings"
            )
        done = {k: v for k, v in man.get("shards", {}).items() if (partial / k).is_file()}
        prior_s = float(man.get("seconds", 0.0))
        log(f"resuming: {len(done)} of {n_shards} shards already written")
    partial.mkdir(parents=True, exist_ok=True)
    for stray in partial.glob(".*.tmp"):  # temporaries of a killed write
        stray.unlink()

    half = half_dtype(cfg)
    if device.type == "cpu" and any(get_quantizer(q).family in ("tcq", "half-tcq") for q in layout.layers.values()):
        log("note: trellis (TCQ) quantization on CPU is slow (~25-50 min per 4096×4096 matrix); "
            "use a GPU (--device cuda) for real models")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    weight_map: dict[str, str] = {}
    bytes_total = {"codes_and_row_scales": 0, "sign_vectors": 0, "codebooks": 0, "unquantized_modules": 0, "total": 0}
    written_now = 0

    def save_manifest():
        atomic_write_json(manifest_path, {"format": PROGRESS_FORMAT, "fingerprint": fingerprint,
                                          "shards": done, "seconds": prior_s + time.time() - t0})

    bar = tqdm(total=n_shards, desc="compress", unit="shard", disable=opts.quiet, initial=len(done))
    for i in range(n_shards):
        fname = shard_name(i, n_shards)
        if fname in done:
            names, cats = done[fname]["tensors"], done[fname]["bytes"]
        else:
            if i < blocks:
                tensors = quantize_block(src, i, layers, layout, device, half,
                                         lambda n: bar.set_postfix_str(n.split("layers.")[-1]),
                                         opts.random_codes)
            else:
                tensors = other_tensors(src, cfg, layout, half)
            atomic_write(partial / fname, safetensors_bytes(tensors, metadata={"format": "pt"}))
            names, cats = sorted(tensors), byte_breakdown(tensors, layout)
            done[fname] = {"tensors": names, "bytes": cats}
            save_manifest()
            written_now += 1
            bar.update(1)
        for n in names:
            weight_map[n] = fname
        for k in bytes_total:
            bytes_total[k] += cats[k]
        if opts.stop_after is not None and written_now >= opts.stop_after and i < n_shards - 1:
            bar.close()
            raise StopAfterShard(f"stopped after {written_now} shards (test hook)")
    bar.close()

    total_n = sum(l.numel for l in layers)
    report = {
        "format": "qpalette.compress-report/1",
        "source": str(opts.model),
        "plan": str(opts.plan) if opts.plan else None,
        "scheme": get_quantizer(opts.scheme).name if opts.scheme else None,
        "avg_bits": sum(l.numel * get_quantizer(layout.layers[l.name]).bits for l in layers) / total_n,
        "bytes": bytes_total,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "wall_time_s": round(prior_s + time.time() - t0, 2),
        "peak_cpu_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "resumed": prior_s > 0,
        "random_codes": opts.random_codes,
    }
    if plan is not None:
        predicted = (plan.get("totals") or {}).get("bytes") or {}
        report["plan_predicted_bytes"] = predicted
        if predicted.get("total") is not None and predicted["total"] != bytes_total["total"]:
            raise CompressError(
                f"written tensor bytes {bytes_total['total']:,} differ from the plan's prediction "
                f"{predicted['total']:,} ({predicted}); this is a bug, please report it"
            )

    # everything but the weights: index, config, tokenizer files, card, report
    atomic_write_json(partial / "model.safetensors.index.json",
                      {"metadata": {"total_size": bytes_total["total"]}, "weight_map": weight_map})
    new_cfg = json.loads((src_dir / "config.json").read_text())
    new_cfg["quantization_config"] = layout.to_config({"random_codes": True} if opts.random_codes else None)
    new_cfg["dtype"] = str(half).removeprefix("torch.")
    new_cfg.pop("torch_dtype", None)
    for f in sorted(src_dir.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, partial / f.name)
    atomic_write(partial / "README.md", model_card(layout, str(opts.model), report))
    atomic_write_json(partial / REPORT_FILE, report)
    atomic_write_json(partial / "config.json", new_cfg)
    manifest_path.unlink()
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return report
