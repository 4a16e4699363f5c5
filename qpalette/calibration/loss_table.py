"""`qpalette loss-table`: the paper's data-aware 'actual' loss terms (docs/method.md §8).

For each linear layer l and palette entry q, the increase of the calibration loss (mean next-token
cross-entropy on real text) when layer l alone is quantized with q: rows[l][q] = CE(model with
W_l ← Ŵ_l) − CE(baseline). Ŵ_l is what a compressed layer computes with, back in W's basis
(`compression.blocks.quantized_weight`: the same rotation, signs and row scales as `compress`,
LDLQ with `--hessians`, nearest rounding otherwise), computed from the original weight. The
baseline is the unquantized model, or with `base` every decoder-block layer quantized with that
entry (the paper's setting); layer l's other entries then replace its base weight.

Only the weight of one layer changes per cell, so the block-input cache (`calibration.evaluator`)
runs blocks l.. only; the weight is restored from a saved copy after each cell. The cells are
quantized a window of blocks at a time (as many as a quarter of the free GPU memory holds), the
layers of one entry and one column count by LDLQ in lockstep (`quant.ldlq.ldlq_many`): a trellis
entry then costs one Viterbi batch per column block for the window instead of one per layer and
block, which is what made TCQ cells slow. Finished cells are
kept in OUTPUT.partial.json (atomically, every layer and every SAVE_EVERY_S); `--resume` skips
them, and also extends a finished OUTPUT with new entries or layers. One device: spreading the
layers over several GPUs (as `calibrate` does) is not implemented.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qpalette.calibration.evaluator import BlockEvaluator
from qpalette.errors import InputError, UnsupportedShape
from qpalette.fileio import atomic_write_json, output_lock, read_json_object
from qpalette.models.topology import HEAD, LayerShape
from qpalette.planning.inputs import LOSS_TABLE_FORMAT
from qpalette.progress import progress_bar
from qpalette.quant.ldlq import DEFAULT_DAMP

PARTIAL_FORMAT = "qpalette.loss_table-partial/1"
GPU_TOKENS = 64 * 2048  # default --tokens on a GPU
CPU_TOKENS = 4 * 2048  # on the CPU: every cell runs the blocks from its layer on, over all tokens
SAVE_EVERY_S = 30.0
LOSS = "mean next-token cross-entropy on the calibration text, minus the baseline's, nats per predicted token"
# header keys a resumed run must share with the unfinished (or finished) one
RESUME_KEYS = ("model_fingerprint", "text_sha256", "tokens_sha256", "loss", "base", "hessians_sha256", "damp",
               "sign_seed")


@dataclass
class LossTableOptions:
    model: str
    output: Path
    text_file: str | None = None
    dataset: str | None = None
    entries: list[str] | None = None  # families and/or entry names; None: the whole palette
    hessians: str | None = None  # a `qpalette hessians` folder: LDLQ rounding
    damp: float = DEFAULT_DAMP
    base: str | None = None  # quantize every block layer with this entry first (the baseline)
    tokens: int = 0  # 0: GPU_TOKENS on a GPU, CPU_TOKENS on the CPU
    seq_len: int = 0  # 0: 2048, or the model's context if shorter
    batch_size: int = 0  # windows per forward pass; 0: automatic
    device: str = "auto"
    layers: str | None = None  # regex on layer names
    resume: bool = False
    progress: bool = True


def check_options(opts: LossTableOptions) -> None:
    if not (opts.text_file or opts.dataset):
        raise InputError("give --text-file FILE or --dataset NAME: the loss table is measured on real text")
    if opts.text_file and opts.dataset:
        raise InputError("give --dataset or --text-file, not both")
    if min(opts.tokens, opts.seq_len, opts.batch_size) < 0:
        raise InputError("--tokens, --seq-len and --batch-size must be positive (0: automatic)")
    if "," in opts.device:
        raise InputError(f"--device {opts.device}: loss-table runs on one device (spreading the layers over "
                         "several GPUs is not implemented)")
    if opts.layers:
        try:
            re.compile(opts.layers)
        except re.error as e:
            raise InputError(f"--layers is not a valid regular expression: {e}") from None


def build_loss_table(opts: LossTableOptions, log: Callable[[str], None] = print) -> dict:
    """Measure (or finish, with opts.resume) the table and write opts.output; returns the document.
    The output's lock (`OUTPUT.lock`, covering the partial file) is held throughout."""
    check_options(opts)
    with output_lock(opts.output, "qpalette loss-table", InputError):
        return _build(opts, log)


@dataclass
class _Setup:
    """What a run works on: the model, its layers, the tokens, the entries and the header."""

    model: torch.nn.Module
    src: object  # SourceCheckpoint: the original weights
    cfg: dict
    layers: list[LayerShape]  # the selected ones
    all_layers: list[LayerShape]
    entries: list[str]
    ids: torch.Tensor
    device: torch.device
    header: dict
    hessians: object | None  # HessianSet
    progress: bool


def _build(opts: LossTableOptions, log: Callable[[str], None]) -> dict:
    t0 = time.perf_counter()
    st = _setup(opts, log)
    output = Path(opts.output)
    partial = output.with_name(output.name + ".partial.json")
    rows = _done_cells(opts, output, partial, st.header, log)
    todo = [(l, q) for l in st.layers for q in st.entries if q not in rows.get(l.name, {}) and _fits(q, l)]
    if st.header["base"]:
        _apply_base(st, st.header["base"], opts.damp)
    batch = opts.batch_size or max(1, (16384 if st.device.type == "cuda" else 2048) // st.ids.shape[1])
    ev = BlockEvaluator(st.model, st.ids, batch, st.device, 0)
    ev.prepare("ce")
    st.header["base_loss"] = ev.base_nll
    saver = _Saver(partial, st.header, rows)
    _measure(st, ev, todo, rows, saver, opts)
    doc = _document(st, rows, opts.layers, {"device": str(st.device), "batch_size": batch,
                                            "cells_measured": len(todo),
                                            "seconds": round(time.perf_counter() - t0, 2)})
    atomic_write_json(output, doc)
    partial.unlink(missing_ok=True)
    return doc


def _setup(opts: LossTableOptions, log: Callable[[str], None]) -> _Setup:
    """Load the model, select the layers, tokenize the text, check the Hessians; the run's header."""
    from qpalette.calibration.hessian_files import HessianSet, model_fingerprint
    from qpalette.calibration.hessians import HessianOptions, calibration_tokens
    from qpalette.compression.source import SourceCheckpoint
    from qpalette.devices import resolve_device
    from qpalette.models.sources import resolve_model
    from qpalette.models.topology import linear_layers, load_config
    from qpalette.planning.planner import parse_palette
    from qpalette.quant.palette import get_quantizer
    from qpalette.runtime.loading import load_model

    entries = [q.name for q in parse_palette(opts.entries)[0]]
    base = get_quantizer(opts.base).name if opts.base else None
    model_dir = resolve_model(opts.model, quiet=not opts.progress)
    cfg = load_config(model_dir)
    all_layers = linear_layers(cfg, lm_head=True)
    layers = [l for l in all_layers if not opts.layers or re.search(opts.layers, l.name)]
    if not layers:
        raise InputError(f"--layers '{opts.layers}' matches no linear layer")
    device = resolve_device(opts.device)
    src = SourceCheckpoint(model_dir)
    fingerprint = model_fingerprint(src, cfg)
    hess = None
    if opts.hessians:
        hess = HessianSet(opts.hessians)
        needed = layers + ([l for l in all_layers if l.name != HEAD] if base else [])
        hess.check(fingerprint, list({l.name: l for l in needed}.values()), cfg["num_hidden_layers"])
    tokens = opts.tokens or (GPU_TOKENS if device.type == "cuda" else CPU_TOKENS)
    text_opts = HessianOptions(opts.model, opts.output, opts.text_file, opts.dataset, tokens, opts.seq_len)
    ids, source, text_sha = calibration_tokens(text_opts, model_dir, cfg, device, log)
    model, _tok = load_model(model_dir, device, torch.float32, tokenizer=False)
    header = _header(opts, fingerprint, cfg, ids, source, text_sha, base, hess)
    return _Setup(model, src, cfg, layers, all_layers, entries, ids, device, header, hess, opts.progress)


def _header(opts, fingerprint: str, cfg: dict, ids: torch.Tensor, source: str, text_sha: str, base: str | None,
            hess) -> dict:
    """What the cells were measured on; RESUME_KEYS of it must match for a run to be resumed."""
    return {
        "format": LOSS_TABLE_FORMAT, "model": str(opts.model), "model_fingerprint": fingerprint,
        "blocks": cfg["num_hidden_layers"], "source": source, "text_sha256": text_sha,
        "tokens_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(), "tokens": ids.numel(),
        "num_seqs": ids.shape[0], "seq_len": ids.shape[1], "loss": LOSS, "base": base, "base_loss": None,
        "rounding": "ldlq" if hess else "nearest",
        "hessians": hess.provenance() if hess else None, "hessians_sha256": hess.digest if hess else None,
        "damp": opts.damp if hess else None, "sign_seed": 0,
    }


def _done_cells(opts: LossTableOptions, output: Path, partial: Path, header: dict,
                log: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """The cells already measured: from the unfinished run (--resume) or, with --resume and no
    unfinished run, from the finished OUTPUT; refuses either when it was measured otherwise."""
    if partial.exists() and not opts.resume:
        raise InputError(f"an unfinished run exists ({partial}); pass --resume to continue it or delete it")
    if not opts.resume:
        return {}
    path = partial if partial.exists() else output if output.exists() else None
    if path is None:
        log(f"--resume: no unfinished run next to {output}; starting a new one")
        return {}
    fmt = PARTIAL_FORMAT if path == partial else LOSS_TABLE_FORMAT
    old = read_json_object(path, "loss table", InputError, fmt, "written by `qpalette loss-table`")
    prev = old.get("header", old)
    diff = [k for k in RESUME_KEYS if prev.get(k) != header.get(k)]
    if diff:
        raise InputError(f"--resume: {path} was measured with other settings ({', '.join(diff)} differ); "
                         "use the same model, text, --tokens, --seq-len, --base and --hessians, or another output")
    rows = {n: dict(r) for n, r in old.get("rows", {}).items()}
    log(f"resuming: {sum(len(r) for r in rows.values())} cells already measured in {path}")
    return rows


class _Saver:
    """Writes the partial file atomically: at every call of `save(force=True)` and otherwise at
    most every SAVE_EVERY_S."""

    def __init__(self, path: Path, header: dict, rows: dict):
        self.path, self.header, self.rows = path, header, rows
        self.last = time.monotonic()

    def save(self, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= SAVE_EVERY_S:
            atomic_write_json(self.path, {"format": PARTIAL_FORMAT, "header": self.header, "rows": self.rows})
            self.last = time.monotonic()


def _signs(l: LayerShape) -> torch.Tensor:
    """The sign vector compress (sign seed 0) rotates layer l with."""
    from qpalette.quant.incoherence import random_signs
    from qpalette.runtime.checkpoint import sign_seed

    return random_signs(l.in_features, sign_seed(0, l.block, l.input_group))


def _original(st: _Setup, l: LayerShape) -> torch.Tensor:
    """Layer l's original weight (float32) from the checkpoint; lm_head's may be the tied embedding."""
    from qpalette.compression.blocks import head_weight

    return head_weight(st.src, st.cfg).float() if l.name == HEAD else st.src.get(f"{l.name}.weight").float()


def _fits(entry: str, l: LayerShape) -> bool:
    from qpalette.quant.palette import get_quantizer

    try:
        get_quantizer(entry).check_shape(l.out_features, l.in_features)
    except UnsupportedShape:
        return False
    return True


def _window_bytes(device: torch.device) -> int:
    """Bytes the quantized weights of one window of blocks may take: a quarter of the free GPU
    memory (LDLQ and the Viterbi batches need the rest), 2 GiB on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 4
    return 2 << 30


def _windows(cells: list[tuple[LayerShape, str]], budget: int) -> list[list[tuple[LayerShape, str]]]:
    """`cells` (in model order) cut at block boundaries into runs whose float32 weights fit `budget`
    (at least one block each)."""
    out: list[list[tuple[LayerShape, str]]] = []
    size = 0
    for i, (l, q) in enumerate(cells):
        new_block = i == 0 or l.block != cells[i - 1][0].block
        if new_block and (not out or size + _block_bytes(cells, i) > budget):
            out.append([])
            size = 0
        out[-1].append((l, q))
        size += 4 * l.out_features * l.in_features
    return out


def _block_bytes(cells: list[tuple[LayerShape, str]], i: int) -> int:
    """float32 bytes of the cells of the block that starts at cells[i]."""
    return sum(4 * l.out_features * l.in_features for l, _ in cells[i:] if l.block == cells[i][0].block)


def _quantize_cells(st: _Setup, cells: list[tuple[LayerShape, str]], damp: float) -> dict[tuple[str, str], torch.Tensor]:
    """Ŵ of every cell (layer name, entry), as `compression.blocks.quantized_weight` makes it; the
    layers of one entry and one column count go through LDLQ together (`quantized_weights`), so a
    trellis entry costs one Viterbi batch per column block for the whole window, not per layer."""
    from qpalette.compression.blocks import quantized_weights

    blocks = sorted({l.block for l, _ in cells})
    hess = {b: st.hessians.load(b) for b in blocks} if st.hessians is not None else None
    groups: dict[tuple[str, int], list[LayerShape]] = {}
    for l, q in cells:
        groups.setdefault((q, l.in_features), []).append(l)
    out = {}
    for (q, _cols), layers in groups.items():
        hs = [hess[l.block][l.input_group] for l in layers] if hess is not None else None
        ws = quantized_weights([_original(st, l) for l in layers], q, [_signs(l) for l in layers], st.device, hs,
                               damp)
        out.update({(l.name, q): w for l, w in zip(layers, ws)})
    return out


def _apply_base(st: _Setup, base: str, damp: float) -> None:
    """Quantize every decoder-block layer the base entry can hold (lm_head stays 16-bit)."""
    cells = [(l, base) for l in st.all_layers if l.name != HEAD and _fits(base, l)]
    windows = _windows(cells, _window_bytes(st.device))
    bar = progress_bar(len(cells), f"base {base}", "layer", st.progress)
    with torch.no_grad(), bar:
        for window in windows:
            for (name, _q), w in _quantize_cells(st, window, damp).items():
                st.model.get_submodule(name).weight.copy_(w)
            bar.update(len(window))


def _measure(st: _Setup, ev: BlockEvaluator, todo: list[tuple[LayerShape, str]], rows: dict, saver: _Saver,
             opts: LossTableOptions) -> None:
    """Measure every (layer, entry) cell of `todo` (entries that hold the layer's shape) in model
    order (the block cache only moves forward) into `rows`, a window of blocks at a time (its
    cells quantized first, together); an interrupted run saves what it has before stopping."""
    bar = progress_bar(len(todo), "loss-table", "cell", st.progress)
    try:
        for window in _windows(todo, _window_bytes(st.device)):
            bar.set_postfix_str(f"quantizing {len(window)} cells")
            w_hats = _quantize_cells(st, window, opts.damp)
            for l, q in window:
                bar.set_postfix_str(f"{l.name} {q}")
                ev.advance_to(l.block)
                rows.setdefault(l.name, {})[q] = _cell(ev, st.model.get_submodule(l.name).weight,
                                                       w_hats.pop((l.name, q)))
                bar.update(1)
                saver.save(force=q == st.entries[-1])
    except torch.cuda.OutOfMemoryError:
        saver.save(force=True)
        raise InputError(f"out of GPU memory: lower --batch-size and rerun with --resume (finished cells are "
                         f"in {saver.path})") from None
    except KeyboardInterrupt:
        saver.save(force=True)
        raise
    finally:
        bar.close()


@torch.no_grad()
def _cell(ev: BlockEvaluator, weight: torch.Tensor, w_hat: torch.Tensor) -> float:
    """CE with `weight` replaced by w_hat, minus the baseline's; the weight is restored exactly."""
    saved = weight.detach().clone()
    weight.copy_(w_hat.to(weight.dtype))
    try:
        return ev.mean_nll() - ev.base_nll
    finally:
        weight.copy_(saved)


def _document(st: _Setup, rows: dict, layer_filter: str | None, timing: dict) -> dict:
    """The table: the run's header, the selected layers' shapes and rows (the requested entries
    only; cells of shapes an entry cannot hold are absent), this session's timing."""
    names = [l.name for l in st.layers]
    kept = {n: {q: rows[n][q] for q in st.entries if q in rows.get(n, {})} for n in names}
    return st.header | {
        "layer_filter": layer_filter, "entries": st.entries,
        "shapes": {l.name: [l.out_features, l.in_features] for l in st.layers},
        "rows": {n: r for n, r in kept.items() if r}, "timing": timing,
    }
