"""`qpalette hessians`: H = XᵀX / n of every quantized layer's input, what LDLQ weighs its
rounding by (docs/method.md §7, qpalette/quant/ldlq.py).

Calibration text (`calibration.data`) is cut into windows of seq_len tokens and embedded once.
Then each decoder block in turn is loaded alone (`calibration.blockstream`), the hidden states of
every window run through it while forward pre-hooks add XᵀX of each input group's input (q/k/v
share one, gate/up share one, o and down have their own), the outputs become the next block's
inputs and the block is freed: memory holds one block and one set of hidden states, never the
activations of all blocks. The final norm of the last output is lm_head's input. Each block's
file is written atomically as soon as it is done (`calibration.hessian_files`); `--resume` keeps
the finished files (those blocks are only run again to rebuild the next inputs), and the
manifest is written last.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qpalette.calibration.blockstream import BlockStream
from qpalette.calibration.data import load_text, text_windows
from qpalette.calibration.hessian_files import (
    FORMAT,
    MANIFEST,
    block_file,
    file_header,
    input_groups,
    model_fingerprint,
    write_file,
)
from qpalette.devices import resolve_device
from qpalette.errors import InputError
from qpalette.fileio import atomic_write_json, output_lock, sha256_file
from qpalette.models.topology import LayerShape, base_model_type, linear_layers, load_config
from qpalette.progress import progress_bar
from qpalette.version import __version__

GPU_TOKENS = 128 * 2048  # the default --tokens on a GPU (QuIP#/QTIP use 6K × 2048-4096 for 8B models)
CPU_TOKENS = 16 * 2048  # on the CPU: 2.3 min for SmolLM2-135M on 2 cores


@dataclass
class HessianOptions:
    model: str
    output: Path
    text_file: str | None = None
    dataset: str | None = None
    tokens: int = 0  # calibration tokens; 0: GPU_TOKENS on a GPU, CPU_TOKENS on the CPU
    seq_len: int = 0  # tokens per window; 0: 2048, or the model's context if shorter
    batch_size: int = 0  # windows per forward pass; 0: 16K tokens on a GPU, 4K on the CPU
    device: str = "auto"
    resume: bool = False
    progress: bool = True


def check_options(opts: HessianOptions) -> None:
    if not (opts.text_file or opts.dataset):
        raise InputError("give --text-file FILE or --dataset NAME (e.g. wikitext2): Hessians are measured "
                         "on real text")
    if opts.text_file and opts.dataset:
        raise InputError("give --dataset or --text-file, not both")
    if min(opts.tokens, opts.seq_len, opts.batch_size) < 0:
        raise InputError("--tokens, --seq-len and --batch-size must be positive (0: automatic)")


def collect_hessians(opts: HessianOptions, log: Callable[[str], None] = print) -> dict:
    """Collect (or finish, with opts.resume) the Hessians of opts.model into opts.output; returns
    the manifest. The folder's lock (`OUTPUT.lock`) is held throughout."""
    check_options(opts)
    with output_lock(opts.output, "qpalette hessians", InputError):
        return _collect(opts, log)


def _collect(opts: HessianOptions, log: Callable[[str], None]) -> dict:
    from qpalette.models.sources import resolve_model

    started = time.perf_counter()
    model_dir = resolve_model(opts.model, quiet=not opts.progress)
    cfg = load_config(model_dir)
    layers = linear_layers(cfg, lm_head=True)
    device = resolve_device(opts.device)
    stream = BlockStream(model_dir, device)
    ids, source, text_sha = calibration_tokens(opts, model_dir, cfg, device, log)
    run = {"model_fingerprint": model_fingerprint(stream.src, cfg), "text_sha256": text_sha,
           "tokens_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
           "num_seqs": ids.shape[0], "seq_len": ids.shape[1]}
    out, blocks = Path(opts.output), cfg["num_hidden_layers"]
    done = finished_files(out, run, blocks, opts.resume, log)
    digests = {name: sha256_file(out / name) for name in done}
    headers = dict(done)
    todo = [b for b in range(blocks + 1) if block_file(b, blocks) not in done]
    common = {"format": FORMAT, "model": str(opts.model), "tokens": ids.numel(), "run": run}

    def save(b: int, hessians: dict[str, torch.Tensor], groups: dict) -> None:
        name = block_file(b, blocks)
        headers[name] = {**common, "block": b, "groups": groups}
        digests[name] = write_file(out / name, hessians, headers[name])

    if todo:
        batch = opts.batch_size or max(1, (16384 if device.type == "cuda" else 4096) // ids.shape[1])
        run_blocks(stream, ids, input_groups(layers), todo, batch, opts.progress, save)
    manifest = {
        "format": FORMAT, "model": str(opts.model), "model_type": base_model_type(cfg), "blocks": blocks,
        **run, "source": source, "tokens": ids.numel(), "dtype": "float32", "device": str(device),
        "qpalette_version": __version__, "resumed": bool(done),
        "seconds": round(time.perf_counter() - started, 2),
        "files": {name: {"block": h["block"], "sha256": digests[name], "groups": h["groups"]}
                  for name, h in sorted(headers.items())},
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def calibration_tokens(opts: HessianOptions, model_dir: Path, cfg: dict, device: torch.device,
                       log: Callable[[str], None]) -> tuple[torch.Tensor, str, str]:
    """(windows [n, seq_len], text source, sha256 of the text)."""
    from transformers import AutoTokenizer

    context = cfg.get("max_position_embeddings") or 2048
    seq_len = opts.seq_len or min(2048, context)
    if seq_len > context:
        raise InputError(f"--seq-len {seq_len} is longer than the model's context ({context} tokens)")
    tokens = opts.tokens or (GPU_TOKENS if device.type == "cuda" else CPU_TOKENS)
    if tokens < seq_len:
        raise InputError(f"--tokens {tokens} is less than one window of --seq-len {seq_len}")
    text, source = load_text(opts.text_file, opts.dataset)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:  # noqa: BLE001 — text_windows says that a tokenizer is needed
        tokenizer = None
    ids = text_windows(tokenizer, text, tokens // seq_len, seq_len)
    if ids.numel() < tokens // seq_len * seq_len:
        log(f"note: the text gives only {ids.shape[0]} windows of {seq_len} tokens ({ids.numel()} tokens)")
    return ids, source, hashlib.sha256(text.encode()).hexdigest()


def finished_files(out: Path, run: dict, blocks: int, resume: bool,
                   log: Callable[[str], None]) -> dict[str, dict]:
    """File name → header of the files a resumed run keeps; refuses a folder of another run."""
    names = [block_file(b, blocks) for b in range(blocks + 1)]
    if not out.exists():
        out.mkdir(parents=True)
        return {}
    present = [n for n in names + [MANIFEST] if (out / n).exists()]
    if present and not resume:
        raise InputError(f"{out} already holds Hessians ({present[0]}); pass --resume to finish them, or "
                         "choose another folder")
    for stray in out.glob(".*.tmp"):  # temporaries of a killed write
        stray.unlink()
    done = {}
    for name in names:
        header = file_header(out / name) if (out / name).is_file() else None
        if header is None:
            continue
        if header["run"] != run:
            raise InputError(f"--resume: {out / name} was collected with other settings (model, text, "
                             "--tokens or --seq-len differ); use the same options, or another folder")
        done[name] = header
    if resume:
        log(f"resuming: {len(done)} of {len(names)} files already written")
    return done


class Accumulator:
    """Σ XᵀX (float32) and the token count of each input group, fed by forward pre-hooks or directly."""

    def __init__(self, sizes: dict[str, int], device: torch.device):
        self.sums = {g: torch.zeros(n, n, device=device) for g, n in sizes.items()}
        self.counts = dict.fromkeys(sizes, 0)
        self._handles = []

    def add(self, group: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sums[group].addmm_(x.T, x)
        self.counts[group] += x.shape[0]

    def hook(self, module: torch.nn.Module, group: str) -> None:
        self._handles.append(module.register_forward_pre_hook(lambda _m, args: self.add(group, args[0])))

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def hessians(self) -> dict[str, torch.Tensor]:
        return {g: s / max(self.counts[g], 1) for g, s in self.sums.items()}

    def groups(self, members: dict[str, list[LayerShape]]) -> dict[str, dict]:
        """The header's description of each group: its layers, input size and token count."""
        return {g: {"layers": [l.name for l in members[g]], "in_features": members[g][0].in_features,
                    "tokens": self.counts[g]} for g in self.sums}


def run_blocks(stream: BlockStream, ids: torch.Tensor, groups: dict[int, dict[str, list[LayerShape]]],
               todo: list[int], batch: int, progress: bool, save: Callable[[int, dict, dict], None]) -> None:
    """Run the blocks up to the last one in `todo` (index len(blocks): lm_head's input), and
    save(block, group → H, group → header entry) those in `todo`."""
    blocks = len(stream.blocks)
    steps = min(max(todo), blocks - 1) + 1
    hidden, kwargs = [], {}
    for i in range(0, ids.shape[0], batch):
        h, kw = stream.embed(ids[i : i + batch])
        hidden.append(h)
        kwargs.setdefault(h.shape[0], kw)
    bar = progress_bar(steps + (blocks in todo), "hessians", "block", progress)
    try:
        for j in range(steps):
            bar.set_postfix_str(f"block {j}" + ("" if j in todo else " (done, replayed)"))
            acc = _run_block(stream, j, hidden, kwargs, groups[j] if j in todo else None)
            if acc is not None:
                save(j, acc.hessians(), acc.groups(groups[j]))
            bar.update(1)
        if blocks in todo:
            bar.set_postfix_str("lm_head")
            acc = Accumulator({"head": groups[blocks]["head"][0].in_features}, stream.device)
            for h in hidden:
                acc.add("head", stream.final_norm(h))
            save(blocks, acc.hessians(), acc.groups(groups[blocks]))
            bar.update(1)
    except torch.cuda.OutOfMemoryError:
        raise InputError(f"out of GPU memory: lower --batch-size (this run: {batch} windows a pass) and "
                         "rerun with --resume (finished blocks are kept)") from None
    finally:
        bar.close()


def _run_block(stream: BlockStream, j: int, hidden: list[torch.Tensor], kwargs: dict,
               members: dict[str, list[LayerShape]] | None) -> Accumulator | None:
    """Replace every hidden state by block j's output; with `members`, accumulate its groups' XᵀX."""
    block = stream.load_block(j)
    acc = None
    if members is not None:
        acc = Accumulator({g: ls[0].in_features for g, ls in members.items()}, stream.device)
        for g, ls in members.items():
            acc.hook(block.get_submodule(ls[0].name.removeprefix(f"model.layers.{j}.")), g)
    try:
        for i, h in enumerate(hidden):
            hidden[i] = stream.run(block, h, kwargs[h.shape[0]][j])
    finally:
        if acc is not None:
            acc.close()
        stream.free_block(j)
    return acc
