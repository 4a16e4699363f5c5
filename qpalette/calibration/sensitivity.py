"""Per-layer sensitivity coefficients a_l by the linearity theorem (docs/method.md §4, HIGGS protocol).

Loss(Q(W)) − Loss(W) ≈ Σ_l a_l · err_l, with err_l = ‖Q(W_l) − W_l‖²_F / ‖W_l‖²_F.

For every linear layer l inside the decoder blocks (and lm_head) and every noise level t_i = t_max · i/levels
(i = 1..levels) the weight is perturbed in place, W_l ← W_l + t_i · ‖W_l‖_F · ε/‖ε‖_F (by
default one ε ~ N(0, I) per layer, scaled over the levels; `directions="fresh"` draws one per
level), and the loss increase is measured over a fixed evaluation set (`calibration.data`).
The loss (`loss`, "auto" by default) is, data-free, the mean KL divergence of the perturbed
model's next-token distribution from the unperturbed one on the model's own samples; data-aware
(`text_file`/`dataset`), the calibration loss itself: the mean next-token cross-entropy of the
text's windows (the paper's 'linear' data-aware loss term; `loss="kl"` keeps the KL on the text).
Since the noise has err = t², fitting ΔLoss ≈ a_l · t² by least squares through the origin gives
a_l in the unit the planner needs (nats per unit of nmse).

Cost: only the blocks from the perturbed one onward run (`calibration.evaluator`). The original
weight is kept aside and copied back after the layer's levels, so nothing drifts. On several
devices (`--device cuda:0,cuda:1`, or under torchrun) each holds a whole copy of the model in its
own process of a torch.distributed group (`qpalette.distributed`) and the layers are dealt
round-robin, one a round; a model too large for one device is split over them in one process
instead (`calibration.placement`). Either way the coefficients are those of a one-device run. An
interrupted run continues from its resume files (`calibration.resume`); the per-layer
measurement is `calibration.noise`.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qpalette.calibration.data import load_text, sample_model, text_windows
from qpalette.calibration.evaluator import linear_layers, module_device
from qpalette.calibration.noise import Settings, fit_through_origin, layer_deltas, noise_levels
from qpalette.calibration.placement import Split, device_budgets, model_units, place
from qpalette.calibration.resume import PartialRun
from qpalette.config import CalibrateConfig
from qpalette.devices import DTYPE_NAMES, dtype_name, peak_gpu_bytes, resolve_devices, resolve_dtype
from qpalette.distributed import (
    Group,
    check_devices,
    finish,
    from_torchrun,
    log_to_stderr,
    resolve_model_in_turn,
    solo,
    spawn,
    under_torchrun,
)
from qpalette.errors import CalibrationError, ModelError
from qpalette.fileio import atomic_write_json, output_lock, read_json_object
from qpalette.progress import progress_bar

FORMAT = "qpalette.sensitivity/1"
# --dtype auto on a GPU: bfloat16 moves a_l by a tenth of what a new noise direction does
# (SmolLM2 on CPU: Spearman 0.9995, median 1.6%; a synthetic 8B on an H100: Spearman 1.0, median
# 0.05%; results/calibrate_smollm2/levels.md) and runs the blocks ~2× faster than TF32.
AUTO_CUDA_DTYPE = "bfloat16"
LOSSES = ("auto", "kl", "ce")
LOSS_TEXT = {
    "kl": "mean next-token KL(original || perturbed), nats per token",
    "ce": "mean next-token cross-entropy on the evaluation tokens, minus the unperturbed model's, "
          "nats per predicted token",
}


# --------------------------------------------------------------------------- the command


@dataclass(kw_only=True)
class CalibrateOptions(CalibrateConfig):
    """A calibration run: its recipe (the CalibrateConfig fields) and where and how it runs."""

    model: str
    output: Path
    devices: list[str] = field(default_factory=lambda: ["cpu"])  # "cpu", "cuda:0", ...; see parse_devices
    max_memory: int | None = None  # bytes of weights a device may hold; beyond, the model is split over the devices
    resume: bool = False
    progress: bool = True


def parse_devices(spec: str) -> list[str]:
    """CalibrateOptions.devices of a --device spec: auto | cpu | cuda (every GPU) | cuda:0,cuda:1 |
    cpu,cpu (several CPU workers); see qpalette.devices.resolve_devices."""
    return [str(d) for d in resolve_devices(spec)]


def check_options(opts: CalibrateOptions) -> None:
    if opts.levels < 2:
        raise CalibrationError("--levels must be at least 2")
    if opts.num_seqs < 1 or opts.seq_len < 2:
        raise CalibrationError("--num-seqs must be ≥ 1 and --seq-len ≥ 2")
    if not (0 < opts.t_max <= 4):
        raise CalibrationError("--t-max must be in (0, 4]")
    if opts.dataset and opts.text_file:
        raise CalibrationError("give --dataset or --text-file, not both")
    if opts.directions not in ("shared", "fresh"):
        raise CalibrationError("--directions: shared or fresh")
    if opts.loss not in LOSSES:
        raise CalibrationError(f"--loss: {', '.join(LOSSES)}")
    if opts.dtype not in DTYPE_NAMES:
        raise CalibrationError(f"--dtype: {', '.join(DTYPE_NAMES)}")
    if not opts.devices:
        raise CalibrationError("no device to calibrate on")
    if opts.max_memory is not None and opts.max_memory <= 0:
        raise CalibrationError("--max-memory must be positive")
    if opts.layers:
        try:
            re.compile(opts.layers)
        except re.error as e:
            raise CalibrationError(f"--layers is not a valid regular expression: {e}") from None


def protocol(opts: CalibrateOptions) -> str:
    return "data-aware" if (opts.dataset or opts.text_file) else "data-free"


def loss_kind(opts: CalibrateOptions) -> str:
    """The measured loss: KL on the model's own samples (data-free) and, on real text, the
    calibration loss itself, next-token cross-entropy, unless opts.loss says otherwise."""
    if opts.loss != "auto":
        return opts.loss
    return "ce" if protocol(opts) == "data-aware" else "kl"


def header(opts: CalibrateOptions, source: str, n_seqs: int) -> dict:
    """What the run measured: the head of the document (and of the resume file)."""
    return {
        "model": opts.model,
        "protocol": protocol(opts),
        "source": source,
        "tokens": n_seqs * opts.seq_len,
        "num_seqs": n_seqs,
        "seq_len": opts.seq_len,
        "levels": opts.levels,
        "t_max": opts.t_max,
        "seed": opts.seed,
        "layer_filter": opts.layers,
        "loss": LOSS_TEXT[loss_kind(opts)],
        "directions": opts.directions,
        **{k: v for k, v in (("targets", opts.targets), ("ignore", opts.ignore)) if v is not None},
        "noise": "W <- W + t*||W||_F*eps/||eps||_F, eps ~ N(0,I) "
                 + ("one per layer, scaled over the levels" if opts.directions == "shared"
                    else "fresh per (layer, level)") + "; err = t^2",
    }


def selected_layers(layers: list[tuple[str, torch.nn.Linear, int]], pattern: str | None) -> list[str]:
    names = [n for n, _m, _b in layers]
    if pattern:
        names = [n for n in names if re.search(pattern, n)]
        if not names:
            raise CalibrationError(f"--layers '{pattern}' matches no linear layer")
    return names


def open_run(opts: CalibrateOptions, n_layers: int, log: Callable[[str], None]) -> PartialRun:
    """The resume files next to opts.output: loaded (and checked) with --resume, else new."""
    output = Path(opts.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    run = PartialRun.next_to(output)
    if not run.exists():
        if opts.resume:
            log(f"--resume: no unfinished run next to {output}; starting a new one")
        return run
    if not opts.resume:
        raise CalibrationError(
            f"an unfinished run exists ({run.partial_path}); pass --resume to continue it or delete it")
    run.load()
    run.check_settings(header(opts, run.header.get("source", ""), run.tokens.shape[0]))
    log(f"resuming: {len(run.layers)}/{n_layers} layers already measured")
    return run


def evaluation_set(opts: CalibrateOptions, model, tokenizer, device: torch.device,
                   log: Callable[[str], None]) -> tuple[torch.Tensor, str]:
    """(tokens [n, seq_len], source): samples of the model (data-free) or windows of the text."""
    if protocol(opts) == "data-free":
        tokens = sample_model(model, tokenizer, opts.num_seqs, opts.seq_len, opts.seed, device,
                              opts.progress)
        return tokens, "model samples, temperature 1"
    text, source = load_text(opts.text_file, opts.dataset)
    tokens = text_windows(tokenizer, text, opts.num_seqs, opts.seq_len)
    if tokens.shape[0] < opts.num_seqs:
        log(f"note: the text gives only {tokens.shape[0]} windows of {opts.seq_len} tokens")
    return tokens, source


def auto_batch(seq_len: int, vocab: int, device: torch.device) -> int:
    """Sequences per forward pass: 12% of the free GPU memory for the logits, 2048 tokens on the CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # sampling's KV caches would hide free memory
        free, _ = torch.cuda.mem_get_info(device)
        tokens = min(int(free * 0.12 / (vocab * 4 * 4)), 32768)
    else:
        tokens = 2048
    return max(1, tokens // seq_len)


def _timing(opts: CalibrateOptions, run: PartialRun, dtype: torch.dtype, batch: int, sampling_s: float,
            devices: list[str], placement: str) -> dict:
    tf32 = opts.dtype == "tf32" and torch.device(devices[0]).type == "cuda"
    return {
        "devices": devices,
        "placement": placement,
        "dtype": dtype_name(dtype) + ("/tf32" if tf32 else ""),
        "batch_size": batch,
        "sampling_s": round(run.timing_prev.get("sampling_s", 0.0) + sampling_s, 3),
    }


def measure_share(group: Group, model, tokens: torch.Tensor, todo: list[str], settings: Settings, device,
                  record: Callable[[str, list[float], float], None] | None = None, bar=None) -> None:
    """This rank's share of `todo`: every world-th layer from its rank on, so its layers come in
    model order (its block cache only moves forward). One layer a round: after each round every
    rank's (name, deltas, seconds) reaches `record` (given on rank 0) in `todo` order, and `bar`
    (rank 0's, in evaluations) counts the other ranks at this one's pace."""
    done = own = active = 0  # evaluations of the finished rounds; this rank's in this round; ranks in it

    def show(n: int) -> None:
        if bar is not None and n > bar.n:
            bar.update(n - bar.n)

    def tick() -> None:
        nonlocal own
        own += 1
        show(done + own * active)

    mine = todo[group.rank::group.world]
    results = layer_deltas(model, tokens, mine, settings, device, tick) if mine else iter(())
    for first in range(0, len(todo), group.world):
        own, active = 0, min(group.world, len(todo) - first)
        for got in group.gather(next(results, None)):
            if got is not None and record is not None:
                record(*got)
        done += active * settings.levels
        show(done)


def measure_layers(group: Group, opts: CalibrateOptions, run: PartialRun, todo: list[str], n_layers: int,
                   settings: Settings, shapes: dict[str, list[int]], model, device) -> None:
    """Rank 0's part of the measurement: its share of `todo`, and every rank's layers fitted and
    saved in the resume file as their round ends, the session's time and memory clocked in run.timing."""
    ts = noise_levels(opts.levels, opts.t_max)
    held_on = list({p.device for p in model.parameters()})  # this process's devices: several for a split model

    def record(name: str, dkl: list[float], seconds: float) -> None:
        a, r2 = fit_through_origin(ts, dkl)
        run.layers[name] = {"a": a, "r2": r2, "shape": shapes[name], f"delta_{settings.loss}": dkl,
                            "seconds": round(seconds, 3)}
        run.clock(time.perf_counter() - t0, peak_gpu_bytes(held_on))
        run.save()

    bar = progress_bar(len(todo) * opts.levels, "calibrate", "eval", opts.progress)
    t0 = time.perf_counter()
    try:
        measure_share(group, model, run.tokens, todo, settings, device, record, bar)
    except KeyboardInterrupt:
        raise CalibrationError(
            f"interrupted: {len(run.layers)}/{n_layers} layers saved in {run.partial_path}; "
            f"rerun with --resume to continue") from None
    except torch.cuda.OutOfMemoryError:
        raise CalibrationError(
            f"out of GPU memory after {len(run.layers)}/{n_layers} layers (saved in {run.partial_path}): "
            f"lower --batch-size (this run: {settings.batch_size} sequences a pass) and rerun with --resume "
            "(the batch size only sets how many sequences run at once)") from None
    finally:
        bar.close()
    run.clock(time.perf_counter() - t0, peak_gpu_bytes(held_on))


def document(opts: CalibrateOptions, run: PartialRun, names: list[str]) -> dict:
    """The sensitivity file: header, the recipe (`config`: the last session's; a resumed run keeps
    the header's settings, its batch size and dtype may differ), per-layer fits, median R², timing
    over every session (`run.timing`, clocked)."""
    layers = {n: run.layers[n] for n in names}
    timing = {
        **run.timing,
        "mean_layer_s": round(statistics.fmean(v["seconds"] for v in layers.values()), 4),
        "evaluations": len(names) * opts.levels,
        "resumed": bool(run.timing_prev),
    }
    return {"format": FORMAT, **run.header, "config": CalibrateConfig.of(opts).to_dict(), "n_layers": len(names),
            "median_r2": statistics.median(v["r2"] for v in layers.values()),
            "layers": layers, "timing": timing}


def calibrate(opts: CalibrateOptions, log: Callable[[str], None] = print) -> dict | None:
    """Run (or resume) a calibration and write opts.output. Returns the written document (None on
    the ranks other than 0 under torchrun).

    Check the options; take the output's lock (before loading the model: a second writer stops at
    once; rank 0's under torchrun); decide where the model goes (`calibration.placement`): split
    over the devices in this process when it does not fit one, else one process per device
    (torch.distributed, `qpalette.distributed.spawn`; under torchrun, this process is one rank);
    then `calibrate_rank`."""
    from qpalette.models.sources import resolve_model

    check_options(opts)
    if under_torchrun():
        group = from_torchrun("cpu" if all(torch.device(d).type == "cpu" for d in opts.devices) else "cuda")
        with output_lock(opts.output, "qpalette calibrate", CalibrationError) if group.main else nullcontext():
            doc = calibrate_rank(group, opts, None, None, log)
        finish(group)
        return doc
    with output_lock(opts.output, "qpalette calibrate", CalibrationError):
        model_dir = resolve_model(opts.model)
        devices = [torch.device(d) for d in opts.devices]
        check_devices(devices, CalibrationError)
        split = placement(opts, model_dir, devices)
        if split is not None or len(devices) == 1:
            return calibrate_rank(solo(devices[0]), opts, model_dir, split, log)
        try:
            spawn(calibrate_rank, devices, opts, model_dir, None, log_to_stderr)
        except KeyboardInterrupt:
            raise CalibrationError(
                f"interrupted: the layers measured so far are saved in {PartialRun.next_to(Path(opts.output)).partial_path}"
                "; rerun with --resume to continue") from None
        return read_json_object(opts.output, "sensitivity file", CalibrationError, FORMAT)


def placement(opts: CalibrateOptions, model_dir: Path, devices: list[torch.device]) -> Split | None:
    """None: a whole copy of the model on each device; else how it is split over them (a
    CalibrationError, before anything is loaded, when it does not fit even so)."""
    if opts.max_memory is None and all(d.type == "cpu" for d in devices):
        return None  # no limit to check
    dtype = resolve_dtype(opts.dtype, devices[0], auto_cuda=AUTO_CUDA_DTYPE)
    try:
        units = model_units(model_dir, dtype)
    except ModelError as e:
        raise CalibrationError(str(e)) from None
    split = place(units, device_budgets(devices, opts.max_memory), [str(d) for d in devices])
    if split is not None:
        try:
            import accelerate  # noqa: F401 — transformers' device_map dispatches through it
        except ImportError:
            raise CalibrationError(
                "the model does not fit one device: splitting it over several needs accelerate "
                "(pip install accelerate, or qpalette[split])") from None
    return split


def _follow(group: Group, opts: CalibrateOptions, model_dir: Path, dtype: torch.dtype) -> None:
    """A rank other than 0: load a copy, take the tokens, layers and settings rank 0 hands out,
    measure this rank's share."""
    from qpalette.runtime.loading import load_model

    device = group.device
    model, _tok = load_model(model_dir, device, dtype, tokenizer=False)
    tokens, todo, settings = group.broadcast(None)
    group.gather(str(device))
    try:
        measure_share(group, model, tokens, todo, settings, device)
    except KeyboardInterrupt:
        raise CalibrationError("interrupted") from None
    except torch.cuda.OutOfMemoryError:
        raise CalibrationError(
            f"out of GPU memory on {device}: lower --batch-size (this run: {settings.batch_size} sequences a "
            f"pass) and rerun with --resume (the layers measured so far are saved in "
            f"{PartialRun.next_to(Path(opts.output)).partial_path})") from None


def calibrate_rank(group: Group, opts: CalibrateOptions, model_dir: Path | None, split: Split | None,
                   log: Callable[[str], None] = print) -> dict | None:
    """One rank's part of a run (the whole run on one device, or on a model split over several):
    rank 0 loads the model, opens (or resumes) the run, draws the evaluation set and hands the
    tokens, the layers left and the settings to the other ranks, which load their own copies
    meanwhile; every rank measures its share (`measure_share`); rank 0 records every layer and
    writes the document, which it returns."""
    from qpalette.runtime.loading import load_model

    t_start = time.perf_counter()
    device = group.device
    if model_dir is None:  # under torchrun: every process holds a whole copy
        model_dir = resolve_model_in_turn(group, opts.model)
        try:
            placement(opts, model_dir, [device])
        except CalibrationError as e:
            raise CalibrationError(f"{e} (under torchrun each process holds a whole copy: run without "
                                   "torchrun, --device cuda:0,cuda:1, to split the model)") from None
    dtype = resolve_dtype(opts.dtype, device, auto_cuda=AUTO_CUDA_DTYPE)
    if not group.main:
        return _follow(group, opts, model_dir, dtype)

    devices = [str(d) for d in opts.devices]
    model, tok = load_model(model_dir, device, dtype, device_map=split.device_map(devices) if split else None)
    try:
        layers = linear_layers(model, opts.targets, opts.ignore)
    except ModelError as e:
        raise CalibrationError(str(e)) from None
    names = selected_layers(layers, opts.layers)
    shapes = {n: list(m.weight.shape) for n, m, _b in layers}
    del layers
    run = open_run(opts, len(names), log)
    run.session_start = t_start  # the session's time includes loading the model

    t_data = time.perf_counter()
    if run.tokens is None:
        tokens, source = evaluation_set(opts, model, tok, device, log)
        run.start(header(opts, source, tokens.shape[0]), tokens)
    sampling_s = time.perf_counter() - t_data

    head = module_device(model.lm_head, device)  # where the logits are
    batch = opts.batch_size or auto_batch(opts.seq_len, model.lm_head.out_features, head)
    settings = Settings(seed=opts.seed, levels=opts.levels, t_max=opts.t_max, batch_size=batch,
                        dtype=opts.dtype, directions=opts.directions, loss=loss_kind(opts))
    todo = [n for n in names if n not in run.layers]
    group.broadcast((run.tokens, todo, settings))
    ranks = group.gather(str(device))
    if split is None:
        devices, where = ranks, "one device" if group.world == 1 else "replicas"
    else:
        devices, where = [devices[d] for d in sorted(set(split.where))], "split"
    run.timing = _timing(opts, run, dtype, batch, sampling_s, devices, where)
    measure_layers(group, opts, run, todo, len(names), settings, shapes, model, device)
    doc = document(opts, run, names)
    atomic_write_json(Path(opts.output), doc)
    run.remove()
    return doc
