"""`qpalette compress`: stream a checkpoint block by block into a qpalette checkpoint.

Per decoder block: read its tensors from the source safetensors, rotate each input group's
layers with one seeded sign vector, quantize every layer (a fused group as one row-concatenated
matrix; by LDLQ with the block's Hessians under `--hessians`, a window of blocks coded together
first), write the block's shard.
Everything goes into `OUT.partial/`, each file written atomically, with a progress manifest after
every shard; the folder is renamed to OUT only when config.json, the index, tokenizer and model
card are all written. So a killed run leaves no folder that looks complete, and `--resume` picks
up at the first missing shard.

On several devices (`--device cuda:0,cuda:1`, or under torchrun; qpalette/distributed.py) each
rank writes a contiguous run of the missing shards and its own progress file; rank 0 merges them,
writes the index, config and card. The shards do not depend on which device made them, so the
checkpoint is the same, byte for byte, as a one-device run's.
"""

from __future__ import annotations

import contextlib
import errno
import functools
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

from qpalette.calibration.hessian_files import HessianSet, model_fingerprint
from qpalette.compression.blocks import byte_breakdown, code_blocks, other_tensors, quantize_block
from qpalette.compression.card import model_card
from qpalette.compression.layout import resolve_layout
from qpalette.compression.source import SourceCheckpoint, half_dtype
from qpalette.config import CompressConfig
from qpalette.devices import peak_gpu_bytes, resolve_device, resolve_devices, tf32_matmuls
from qpalette.distributed import (
    Group,
    check_devices,
    from_torchrun,
    log_to_stderr,
    resolve_model_in_turn,
    solo,
    spawn,
    under_torchrun,
)
from qpalette.distributed import finish as leave_group
from qpalette.errors import CompressError, ModelError
from qpalette.fileio import atomic_write, atomic_write_json, output_lock, read_json_object
from qpalette.models.topology import (
    HEAD,
    LayerShape,
    base_model_type,
    check_config,
    checkpoint_model_type,
    load_config,
)
from qpalette.planning.document import Plan
from qpalette.progress import progress_bar
from qpalette.quant.ldlq import DEFAULT_DAMP
from qpalette.quant.palette import get_quantizer
from qpalette.runtime.checkpoint import Layout
from qpalette.runtime.integrity import shard_bytes
from qpalette.version import __version__

PROGRESS_FORMAT = "qpalette.compress-progress/1"
PROGRESS_FILE = "qpalette-progress.json"
RANK_PROGRESS = "qpalette-progress.{rank}.json"  # ranks 1.. of a run on several devices
REPORT_FILE = "qpalette-compress.json"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "README.md", PROGRESS_FILE}
_CATEGORIES = ("codes_and_row_scales", "sign_vectors", "codebooks", "unquantized_modules", "total")
WINDOW_FRACTION = 0.25  # of the free GPU memory, for the blocks whose matrices go through LDLQ together
CPU_WINDOW_BYTES = 2 << 30
LDLQ_BYTES_PER_WEIGHT = 20  # float32 weight, rotated copy, target, error and reconstruction


@dataclass(kw_only=True)
class CompressOptions(CompressConfig):
    """A compression run: its recipe (the CompressConfig fields: scheme, fuse, sign_seed, lm_head,
    damp) and its inputs, output and way of running."""

    model: str
    output: Path
    plan: Path | None = None
    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False
    random_codes: bool = False  # speed benchmarks of random-weight models: skip the quantizer
    hessians: Path | None = None  # a `qpalette hessians` folder: data-aware LDLQ instead of nearest rounding


@dataclass
class Job:
    """Everything a run needs, checked before any work starts."""

    opts: CompressOptions
    src_dir: Path
    cfg: dict
    layers: list[LayerShape]
    layout: Layout
    plan: Plan | None
    device: torch.device
    src: SourceCheckpoint
    out: Path
    hessians: HessianSet | None = None
    group: Group | None = None
    mine: list[int] = field(default_factory=list)  # the shards this rank writes, in order
    started: float = field(default_factory=time.time)
    coded: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)  # data-aware blocks made ahead

    @property
    def partial(self) -> Path:
        return self.out.with_name(self.out.name + ".partial")

    @property
    def n_shards(self) -> int:
        return self.cfg["num_hidden_layers"] + 1

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a resumed run must share with the run it continues (source files stat'ed once)."""
        data_aware = {"hessians": self.hessians.digest, "damp": self.opts.damp} if self.hessians else {}
        return hashlib.sha256(json.dumps(
            {"layout": self.layout.to_config(), "source": self.src.fingerprint(), "device": self.device.type,
             "version": __version__, "random_codes": self.opts.random_codes, **data_aware},
            sort_keys=True).encode()
        ).hexdigest()[:16]

    def data_aware(self) -> dict | None:
        """How the layers were rounded when data-aware (None: nearest rounding, data-free)."""
        return data_aware_record(self.hessians, self.opts.damp)


def data_aware_record(hessians: HessianSet | None, damp: float) -> dict | None:
    """The checkpoint's record of data-aware rounding (None: nearest rounding, data-free)."""
    if hessians is None:
        return None
    return {"method": "ldlq", "damp": damp, "hessians": hessians.provenance()}


def prepare_job(opts: CompressOptions, group: Group | None = None) -> Job:
    """Resolve the model, the layout and the device (`group`'s on several devices); refuse what
    cannot work before any work."""
    from qpalette.models.sources import resolve_model

    if (opts.plan is None) == (opts.scheme is None):
        raise CompressError("give exactly one of --plan PLAN.json or --scheme ENTRY (e.g. tcq-3.0)")
    try:
        src_dir = resolve_model(opts.model, quiet=opts.quiet)
        cfg = load_config(src_dir)
        check_config(cfg)
    except ModelError as e:
        raise CompressError(str(e)) from None
    layout, plan, layers = resolve_layout(cfg, opts.scheme, opts.plan, opts.lm_head, opts.fuse, opts.sign_seed,
                                          opts.targets, opts.ignore)
    group = group or solo(resolve_device(opts.device))
    src = SourceCheckpoint(src_dir)
    missing = [f"{l.name}.weight" for l in layers if f"{l.name}.weight" not in src.files
               and not (l.name == HEAD and "model.embed_tokens.weight" in src.files)]
    if missing:
        raise CompressError(f"{src_dir}: weights missing from the checkpoint: {missing[:3]}")
    if opts.hessians is not None and opts.random_codes:
        raise CompressError("--hessians and --random-codes exclude each other")
    hessians = open_hessians(opts.hessians, opts.damp, src, cfg, layers)
    out = Path(opts.output)
    if out.exists() and any(out.iterdir()) and not opts.overwrite:
        raise CompressError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    return Job(opts, src_dir, cfg, layers, layout, plan, group.device, src, out, hessians, group)


def open_hessians(folder: Path | None, damp: float, src, cfg: dict, layers: list[LayerShape]) -> HessianSet | None:
    """The --hessians folder, checked against the model (`src`: its tensors) and the layers to
    quantize; None without."""
    if folder is None:
        if damp != DEFAULT_DAMP:
            raise CompressError("--damp goes with --hessians (it damps LDLQ's Hessians)")
        return None
    if not damp >= 0:
        raise CompressError(f"--damp {damp}: the damping must be ≥ 0 (default {DEFAULT_DAMP})")
    hessians = HessianSet(folder)
    hessians.check(model_fingerprint(src, cfg), layers, cfg["num_hidden_layers"])
    return hessians


def save_manifest(job: Job, done: dict[str, dict], seconds: float) -> None:
    """OUT.partial's progress file (rank 0's; each other rank has its own): the finished shards,
    the run's fingerprint, the time spent."""
    rank = job.group.rank if job.group else 0
    name = RANK_PROGRESS.format(rank=rank) if rank else PROGRESS_FILE
    atomic_write_json(job.partial / name, {
        "format": PROGRESS_FORMAT, "fingerprint": job.fingerprint, "shards": done, "seconds": seconds})


def progress_files(partial: Path) -> list[Path]:
    """Rank 0's progress file, then those of the other ranks of a run on several devices."""
    return [partial / PROGRESS_FILE, *sorted(partial.glob(RANK_PROGRESS.format(rank="*")))]


def open_partial(job: Job, log: Callable[[str], None]) -> tuple[dict[str, dict], float]:
    """(shards already written, seconds already spent) of OUT.partial, created if new."""
    partial, done, prior_s = job.partial, {}, 0.0
    if partial.exists():
        if not job.opts.resume:
            raise CompressError(f"{partial} holds a previous unfinished run; continue it with --resume or delete it")
        for path in progress_files(partial):
            man = read_json_object(path, "compress progress", CompressError, PROGRESS_FORMAT)
            if man.get("fingerprint") != job.fingerprint:
                raise CompressError(
                    f"{partial} was started with other settings (model, plan/scheme, seed, device or "
                    "qpalette version differ); delete it or run with the same settings"
                )
            done.update({k: v for k, v in man.get("shards", {}).items() if (partial / k).is_file()})
            prior_s = max(prior_s, float(man.get("seconds", 0.0)))  # the ranks ran side by side
        log(f"resuming: {len(done)} of {job.n_shards} shards already written")
    else:  # the manifest first: a run killed before its first shard can still be resumed
        partial.mkdir(parents=True)
        save_manifest(job, done, 0.0)
    for stray in partial.glob(".*.tmp"):  # temporaries of a killed write
        stray.unlink()
    return done, prior_s


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def shard_tensors(job: Job, i: int, on_layer: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Shard i: decoder block i, or (the last one) everything outside the blocks. Data-aware
    blocks are coded a window at a time (`code_window`) and kept until their shard is written."""
    half, last = half_dtype(job.cfg), i == job.n_shards - 1
    if not last:
        if job.hessians is not None and i not in job.coded:
            job.coded.update(code_window(job, i, on_layer))
        return quantize_block(job.src, i, job.layers, job.layout, job.device, half, on_layer,
                              job.opts.random_codes, coded=job.coded.pop(i, None))
    hessians = job.hessians.load(i) if job.hessians is not None and HEAD in job.layout.layers else None
    return other_tensors(job.src, job.cfg, job.layout, job.device, half, job.opts.random_codes, hessians,
                         job.opts.damp)


def code_window(job: Job, first: int, on_layer: Callable[[str], None]) -> dict[int, list[dict[str, torch.Tensor]]]:
    """The coded matrices of this rank's blocks from `first` on (as many as WINDOW_FRACTION of
    the free memory holds in LDLQ's float32 working copies, at least one), through LDLQ together
    (`code_blocks`)."""
    if job.device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(job.device)[0] * WINDOW_FRACTION)
    else:
        budget = CPU_WINDOW_BYTES
    blocks, size = [], 0
    for b in (b for b in job.mine if first <= b < job.cfg["num_hidden_layers"]):
        need = LDLQ_BYTES_PER_WEIGHT * sum(l.numel for l in job.layers if l.block == b and l.name != HEAD)
        if blocks and size + need > budget:
            break
        blocks.append(b)
        size += need
    return code_blocks(job.src, {b: job.hessians.load(b) for b in blocks}, job.layers, job.layout, job.device,
                       job.opts.damp, on_layer)


def write_shards(job: Job, done: dict[str, dict], prior_s: float) -> dict[str, dict]:
    """Write this rank's shards (`job.mine`), its progress file after each; returns the shards its
    progress file records (rank 0's also holds those of earlier sessions)."""
    group = job.group
    own = dict(done) if group.main else {}
    desc = "compress" if group.world == 1 else f"compress [{job.device}]"
    initial = len(done) if group.world == 1 else 0
    bar = progress_bar(initial + len(job.mine), desc, "shard", not job.opts.quiet, initial=initial,
                       position=group.rank)
    with bar:
        for i in job.mine:
            fname = shard_name(i, job.n_shards)
            with _resumable(job, fname):
                tensors = shard_tensors(job, i, lambda n: bar.set_postfix_str(n.split("layers.")[-1]))
                atomic_write(job.partial / fname, shard_bytes(tensors))
                own[fname] = {"tensors": sorted(tensors), "bytes": byte_breakdown(tensors, job.layout)}
                save_manifest(job, own, prior_s + time.time() - job.started)
            bar.update(1)
    return own


def index_shards(job: Job, done: dict[str, dict]) -> tuple[dict[str, str], dict[str, int]]:
    """(weight map, bytes by category) of every shard, from the progress records."""
    weight_map: dict[str, str] = {}
    totals = dict.fromkeys(_CATEGORIES, 0)
    for i in range(job.n_shards):
        fname = shard_name(i, job.n_shards)
        weight_map.update(dict.fromkeys(done[fname]["tensors"], fname))
        for k in totals:
            totals[k] += done[fname]["bytes"][k]
    return weight_map, totals


@contextlib.contextmanager
def _resumable(job: Job, fname: str):
    """Out of disk space or of GPU memory while making a shard → one line with the way out; the
    shards written so far stay in OUT.partial for --resume (the failed one was never renamed in)."""
    again = f"then continue with the same command and --resume ({job.partial} keeps the finished shards)"
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise CompressError(
            f"out of GPU memory while quantizing {fname}: free the GPU, or quantize on the CPU (--device cpu, "
            f"slow for trellis entries); {again}") from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
            raise
        raise CompressError(f"cannot write {fname} into {job.partial}: {e.strerror}; make room, {again}") from None


def make_report(job: Job, totals: dict[str, int], prior_s: float, ranks: list[dict]) -> dict:
    """The run's report (`ranks`: each rank's device, shards and peak memory); checks the written
    bytes against the plan's prediction."""
    opts = job.opts
    peaks = [r["peak_gpu_bytes"] for r in ranks if r["peak_gpu_bytes"] is not None]
    total_n = sum(l.numel for l in job.layers)
    report = {
        "format": "qpalette.compress-report/1",
        "source": str(opts.model),
        "plan": str(opts.plan) if opts.plan else None,
        "scheme": get_quantizer(opts.scheme).name if opts.scheme else None,
        "avg_bits": sum(l.numel * get_quantizer(job.layout.layers[l.name]).bits for l in job.layers) / total_n,
        "bytes": totals,
        "device": (f"{len(ranks)}× " if len(ranks) > 1 else "") + ranks[0]["name"],
        "wall_time_s": round(prior_s + time.time() - job.started, 2),
        "peak_cpu_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": max(peaks) if peaks else None,  # of one device
        "ranks": ranks,
        "resumed": prior_s > 0,
        "random_codes": opts.random_codes,
        "data_aware": job.data_aware(),
        "config": CompressConfig.of(opts).to_dict(),
    }
    if job.plan is not None:
        predicted = job.plan.totals.get("bytes") or {}
        report["plan_predicted_bytes"] = predicted
        if predicted.get("total") is not None and predicted["total"] != totals["total"]:
            raise CompressError(
                f"written tensor bytes {totals['total']:,} differ from the plan's prediction "
                f"{predicted['total']:,} ({predicted}); this is a bug, please report it"
            )
    return report


def finish(job: Job, weight_map: dict[str, str], report: dict) -> None:
    """Index, config, tokenizer files, card and report into OUT.partial, then rename it to OUT."""
    partial = job.partial
    atomic_write_json(partial / "model.safetensors.index.json",
                      {"metadata": {"total_size": report["bytes"]["total"]}, "weight_map": weight_map})
    new_cfg = json.loads((job.src_dir / "config.json").read_text())
    extra = {"random_codes": True} if job.opts.random_codes else {}
    if report["data_aware"] is not None:
        extra["data_aware"] = report["data_aware"]
    new_cfg["quantization_config"] = job.layout.to_config(extra or None)
    new_cfg["dtype"] = str(half_dtype(job.cfg)).removeprefix("torch.")
    new_cfg["model_type"] = checkpoint_model_type(base_model_type(job.cfg))  # plain transformers refuses it
    if HEAD in job.layout.layers:  # the embedding stays 16-bit: a quantized head cannot share it
        new_cfg["tie_word_embeddings"] = False
    new_cfg.pop("torch_dtype", None)
    for f in sorted(job.src_dir.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, partial / f.name)
    atomic_write(partial / "README.md", model_card(job.layout, str(job.opts.model), report, new_cfg["model_type"]))
    atomic_write_json(partial / REPORT_FILE, report)
    atomic_write_json(partial / "config.json", new_cfg)
    if job.out.exists():
        shutil.rmtree(job.out)
    for extra in progress_files(partial)[1:]:  # the other ranks' (rank 0's, the last to go, says what is done)
        extra.unlink()
    os.replace(partial, job.out)  # killed before this: OUT.partial still has its manifest, --resume
    (job.out / PROGRESS_FILE).unlink()


def rank_record(job: Job, shards: int) -> dict:
    """This rank's line of the report."""
    cuda = job.device.type == "cuda"
    return {"device": str(job.device), "name": torch.cuda.get_device_name(job.device) if cuda else "cpu",
            "shards": shards, "peak_gpu_bytes": peak_gpu_bytes([job.device])}


def compress(opts: CompressOptions, log: Callable[[str], None] = print) -> dict | None:
    """Run (or resume) the whole compression; returns the report (also OUT/qpalette-compress.json;
    None on a torchrun rank other than 0).

    `opts.device` with several devices (cuda:0,cuda:1; cpu,cpu) starts one process for each; under
    torchrun this process is one rank of the group torchrun made. The whole run holds OUT.lock
    (`output_lock`; rank 0's under torchrun), taken before OUT is checked or OUT.partial opened:
    a second run on the same OUT (two --resume runs included) stops at once."""
    if under_torchrun():
        group = from_torchrun(opts.device)
        with output_lock(opts.output, "qpalette compress", CompressError) if group.main else contextlib.nullcontext():
            report = compress_rank(group, opts, log)
        leave_group(group)  # on success only: a failed rank is not waited for, torchrun's agent stops the others
        return report
    devices = resolve_devices(opts.device) if "," in opts.device else [resolve_device(opts.device)]
    check_devices(devices, CompressError)
    with output_lock(opts.output, "qpalette compress", CompressError):
        if len(devices) == 1:
            return compress_rank(solo(devices[0]), opts, log)
        spawn(compress_rank, devices, opts, log_to_stderr)
        return read_json_object(Path(opts.output) / REPORT_FILE, "compress report", CompressError)


def compress_rank(group: Group, opts: CompressOptions, log: Callable[[str], None] = print) -> dict | None:
    """One rank's part of the run (the whole run on one device): rank 0 opens OUT.partial, every
    rank writes its share of the missing shards, rank 0 gathers their records and finishes.
    Returns the report on rank 0, None on the others."""
    if group.world > 1:  # never several ranks fetching or converting the model at once
        try:
            resolve_model_in_turn(group, opts.model, opts.quiet)
        except ModelError as e:
            raise CompressError(str(e)) from None
    job = prepare_job(opts, group)
    if group.main:
        done, prior_s = open_partial(job, log)
        save_manifest(job, done, prior_s)  # the other ranks' records of earlier sessions, merged, before they restart theirs
    done, prior_s, fingerprint = group.broadcast((done, prior_s, job.fingerprint) if group.main else None)
    job.__dict__["fingerprint"] = fingerprint  # every progress file under rank 0's (source mtimes differ between machines)
    job.mine = group.share([i for i in range(job.n_shards) if shard_name(i, job.n_shards) not in done])
    if group.main and job.device.type == "cpu" and any(
            get_quantizer(q).family in ("tcq", "half-tcq") for q in job.layout.layers.values()):
        log("note: trellis (TCQ) quantization on CPU is slow (~25-50 min per 4096×4096 matrix); "
            "use a GPU (--device cuda) for real models")
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.device)
    # full-precision float32 matmuls while quantizing, whatever the process set before (calibrate
    # with --dtype tf32 turns TF32 on for its process): the same bytes from a fresh process and from
    # one that calibrated first; the caller's settings come back after
    with tf32_matmuls(False):
        own = write_shards(job, done, prior_s)
    records = group.gather((own, rank_record(job, len(job.mine))))
    if not group.main:
        return None
    for shards, _ in records[1:]:
        done.update(shards)
    done.update(records[0][0])
    save_manifest(job, done, prior_s + time.time() - job.started)  # all of them in rank 0's, before `finish` drops the others
    weight_map, totals = index_shards(job, done)
    report = make_report(job, totals, prior_s, [r for _, r in records])
    finish(job, weight_map, report)
    return report
