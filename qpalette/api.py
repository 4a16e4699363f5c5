"""The library API: one function per pipeline step. The `qpalette` command line is a thin layer
over these; every user mistake raises a `qpalette.errors.QpaletteError` with a message.

    import qpalette
    sens = qpalette.calibrate("smollm2-135m", "sens.json")
    plan = qpalette.plan("smollm2-135m", "3.25bits", sensitivity="sens.json", output="plan.json")
    qpalette.compress("smollm2-135m", "plan.json", "smollm2-q")      # or a scheme: "tcq-3.0"
    model = qpalette.from_pretrained("smollm2-q")

Stages are imported when called, so `import qpalette` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from qpalette.config import CalibrateConfig, CompressConfig, PlanConfig
from qpalette.errors import InputError

if TYPE_CHECKING:
    import torch

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


def palette(families: tuple[str, ...] | None = None, *, measure: bool = False, rows: int = 1024,
            cols: int = 1024, device: str = "cpu", seed: int = 0, write: str | Path | None = None,
            log: Log = _quiet) -> list:
    """The palette's distortion rows (each entry's normalised MSE on Gaussian data against the
    2^(-2b) bound): the shipped table, or measured now on a fresh rows×cols Gaussian matrix
    (`measure`, optionally written to `write`)."""
    from qpalette.devices import resolve_device
    from qpalette.quant.distortion import DistortionTable, measure_table
    from qpalette.quant.palette import FAMILIES, palette_entries

    unknown = set(families or ()) - set(FAMILIES)
    if unknown:
        raise InputError(f"unknown family {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    entries = palette_entries(tuple(families) if families else None)
    if not measure:
        table = DistortionTable.load().rows
        return [table[q.name] for q in entries if q.name in table]
    dev = str(resolve_device(device))
    table = measure_table(entries, rows, cols, seed, dev, lambda r: log(f"  measured {r.name:>14}  nmse {r.nmse:.5f}"))
    if write:
        table.save(write)
    return list(table.rows.values())


def calibrate(model: str, output: str | Path = "sens.json", config: CalibrateConfig | None = None, *,
              devices: str = "auto", max_memory: str | int | None = None, resume: bool = False,
              progress: bool = True, log: Log = _quiet, **fields) -> dict | None:
    """Per-layer sensitivities a_l (the coefficients of Loss(Q(W)) − Loss(W) ≈ Σ a_l·err_l),
    written to `output` and returned; the file records `config` under "config".

    `config`: a `CalibrateConfig` (default: its defaults); `fields`, its field names as keywords
    (num_seqs=64, targets=[...], ...), override it. `devices`: auto, cpu, cuda, cuda:0,cuda:1 (a
    whole copy of the model on each, one process each; docs/distributed.md); `max_memory`: the
    weights one device may hold ("20GiB", or bytes): a model larger than that is split over the
    devices instead; `resume`: continue an interrupted run of `output`. Under torchrun, only rank
    0 returns the document (the other ranks None)."""
    from qpalette.calibration.sensitivity import CalibrateOptions, parse_devices
    from qpalette.calibration.sensitivity import calibrate as run
    from qpalette.devices import parse_memory

    cfg = (config or CalibrateConfig()).updated(**fields)
    opts = CalibrateOptions(model=model, output=Path(output), devices=parse_devices(devices), resume=resume,
                            max_memory=parse_memory(max_memory) if isinstance(max_memory, str) else max_memory,
                            progress=progress, **cfg.values())
    return run(opts, log=log)


def hessians(model: str, output: str | Path, *, log: Log = _quiet, **options) -> dict:
    """H = XᵀX/n of every quantized layer's input on calibration text, written to the folder
    `output` for `compress(..., hessians=output)` (data-aware LDLQ rounding); returns the
    manifest. `options` are the fields of `qpalette.calibration.hessians.HessianOptions` (text_file
    or dataset, tokens, seq_len, batch_size, device, resume, progress)."""
    from qpalette.calibration.hessians import HessianOptions, collect_hessians

    return collect_hessians(HessianOptions(model=model, output=Path(output), **options), log=log)


def loss_table(model: str, output: str | Path, *, log: Log = _quiet, **options) -> dict:
    """The measured loss terms for `plan` (each layer alone quantized by each entry, the
    increase of cross-entropy on calibration text), written to `output` for
    `plan(..., loss_table=output)`; returns the table. `options` are the fields of
    `qpalette.calibration.loss_table.LossTableOptions` (text_file or dataset, entries, hessians,
    damp, base, tokens, seq_len, batch_size, device, layers, resume, progress)."""
    from qpalette.calibration.loss_table import LossTableOptions, build_loss_table

    return build_loss_table(LossTableOptions(model=model, output=Path(output), **options), log=log)


def plan(model: str | None, budget: str | list[str] | None = None, *, config: PlanConfig | None = None,
         sensitivity: str | Path | None = None, loss_table: str | Path | None = None,
         latency_profile: str | Path | None = None, distortion: str | Path | None = None,
         output: str | Path | None = None, plot: str | Path | None = None, **fields):
    """The plan minimising the predicted loss under `budget` ("3.25bits", "2.4GB", "200tok/s";
    a list or comma list combines them: all must hold); written to `output` (and a bits-per-layer
    PNG to `plot`) when given; the plan records its `PlanConfig` under "config".

    `config`: a `PlanConfig`; `budget` and `fields` (palette, fuse, batch_size, time_limit_s,
    lm_head, targets/ignore: regular expressions choosing the layers) override it. Inputs:
    `sensitivity` (calibrate's file), `loss_table` (a `loss_table` file whose measured losses
    replace a_l·err(q); `sensitivity` is then optional), `latency_profile` (for tok/s and ms
    budgets), `distortion` (default: the shipped table)."""
    from qpalette.planning.document import plot_plan, write_plan
    from qpalette.planning.planner import plan as make

    if budget is not None:
        fields["budget"] = [budget] if isinstance(budget, str) else list(budget)
    cfg = (config or PlanConfig()).updated(**fields)
    if not cfg.budget:
        raise InputError("give a budget (e.g. 3.25bits, 2.4GB, 200tok/s)")
    inputs = {"sensitivity": sensitivity, "loss_table": loss_table, "latency_profile": latency_profile,
              "distortion": distortion}
    result = make(model, cfg.budget, **{k: None if v is None else str(v) for k, v in inputs.items()},
                  palette=cfg.palette, fuse=cfg.fuse, batch_size=cfg.batch_size, time_limit_s=cfg.time_limit_s,
                  lm_head=cfg.lm_head, targets=cfg.targets, ignore=cfg.ignore)
    if output is not None:
        write_plan(result, output)
    if plot is not None:
        plot_plan(result, plot)
    return result


def load_plan(path: str | Path):
    """A plan file written by `plan`."""
    from qpalette.planning.document import load_plan as load

    return load(path)


def describe_plan(plan, blocks_only: bool = False, layers: bool = True) -> str:
    """A plan as text: the summary, then one line per block (`blocks_only`) or per layer."""
    from qpalette.planning.document import block_table, layer_table, summary

    parts = [summary(plan)]
    if blocks_only or not layers:
        parts.append(block_table(plan))
    else:
        parts.append(layer_table(plan))
    return "\n".join(parts)


def compress(model: str, plan_or_scheme: str | Path, out_dir: str | Path, config: CompressConfig | None = None, *,
             device: str = "auto", hessians: str | Path | None = None, resume: bool = False,
             overwrite: bool = False, quiet: bool = False, random_codes: bool = False, log: Log = _quiet,
             **fields) -> dict | None:
    """Rotate and quantize `model` into a qpalette checkpoint in `out_dir`; returns the report
    (also `out_dir`/qpalette-compress.json, which records the `CompressConfig` under "config";
    None on a torchrun rank other than 0). `device`: cuda:0,cuda:1 spreads the blocks over them.

    `plan_or_scheme`: a plan file from `plan`, or one palette entry for every layer ("tcq-3.0").
    `config`: a `CompressConfig`; `fields` (fuse, sign_seed, lm_head, damp, targets/ignore:
    regular expressions choosing the layers, by default a plan's, or every linear layer of the
    decoder blocks less MoE routers) override it. `hessians`: a folder from `hessians`, for
    data-aware LDLQ rounding. `resume` continues a killed run; `overwrite` replaces an existing
    `out_dir`; `random_codes` (speed tests only) stores random code words instead of quantizing."""
    from qpalette.compression.layout import plan_or_scheme as parse
    from qpalette.compression.writer import CompressOptions
    from qpalette.compression.writer import compress as run

    scheme, plan_file = parse(plan_or_scheme)
    cfg = (config or CompressConfig()).updated(**fields, scheme=scheme)
    opts = CompressOptions(model=model, output=Path(out_dir), plan=plan_file, device=device, resume=resume,
                           overwrite=overwrite, quiet=quiet, random_codes=random_codes,
                           hessians=None if hessians is None else Path(hessians), **cfg.values())
    return run(opts, log=log)


def quantize(model, plan_or_scheme: str | Path, config: CompressConfig | None = None, *,
             hessians: str | Path | None = None, device: str = "auto", **fields):
    """Quantize an already loaded transformers model in place (returned): the same modules and the
    same numbers as `compress` then loading the checkpoint, without writing files.

    `plan_or_scheme`: a plan file from `plan`, or one palette entry for every layer ("tcq-3.0");
    `config`: a `CompressConfig`, `fields` (fuse, sign_seed, lm_head, damp, targets/ignore) override
    it; `hessians`: a folder from `hessians` (data-aware LDLQ rounding, as `compress`); `device`:
    where to quantize. To keep the result, use `compress`."""
    from qpalette.compression.in_memory import quantize_model
    from qpalette.compression.layout import plan_or_scheme as parse

    scheme, plan_file = parse(plan_or_scheme)
    cfg = (config or CompressConfig()).updated(**fields, scheme=scheme)
    return quantize_model(model, plan_file, cfg, hessians=hessians, device=device)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               *, tokenizer: bool = True):
    """(model, tokenizer) of an original or compressed model directory, or anything
    `qpalette.models.sources.resolve_model` accepts (a .gguf, the embedded 'smollm2-135m')."""
    from qpalette.models.sources import resolve_model
    from qpalette.runtime.loading import load_model as load

    return load(resolve_model(path, quiet=True), device, dtype, tokenizer=tokenizer)


def from_pretrained(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """A qpalette checkpoint, ready to run: CUDA and float16 when a GPU is present, else CPU and float32."""
    from qpalette.runtime.loading import from_pretrained as load

    return load(path, device, dtype)


def evaluate(model: str, *, log: Log = _quiet, **options) -> dict:
    """Perplexity and/or data-free KL to a reference; `options` are the fields of
    `qpalette.measure.evaluate.EvalOptions` (dataset, text_file, ctx, max_windows, kl_to, ...)."""
    from qpalette.measure.evaluate import EvalOptions
    from qpalette.measure.evaluate import evaluate as run

    return run(EvalOptions(model=model, **options), log=log)


def generate(model, tokenizer=None, prompts: str | list[str] = "", *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False,
             device: str = "auto", on_text: Callable[[int, str], None] | None = None, graphs: bool | None = None,
             stop_at_eos: bool = True):
    """Text for each prompt from qpalette's decoder (static KV cache, decode steps replayed as CUDA
    graphs, the next token chosen on the GPU); returns a `qpalette.generation.Generation` (texts,
    token ids, timings). `model`: a loaded model (with its `tokenizer`), or a path / model name,
    loaded here on `device`. Greedy when temperature is 0; `seed` makes sampling reproducible.
    `on_text(i, piece)` streams prompt i's text as it is decoded."""
    from qpalette.generation import SamplingOptions
    from qpalette.generation import generate as run

    if isinstance(model, (str, Path)):
        from qpalette.devices import resolve_device

        model, loaded_tok = load_model(model, resolve_device(device))
        tokenizer = tokenizer or loaded_tok
    sampling = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return run(model, tokenizer, prompts, max_new_tokens=max_new_tokens, sampling=sampling, chat=chat,
               on_text=on_text, stop_at_eos=stop_at_eos, graphs=graphs)


def bench(model: str, *, json_out: str | Path | None = None, log: Log = _quiet, **options) -> dict:
    """Decode tokens/s (qpalette's decoder, transformers' generate, the compiled forward loop), also
    written to `json_out`; `options` are the fields of `qpalette.measure.bench.BenchOptions`
    (batch_sizes, prompt_len, gen_len, device, compile, compile_modes, ways)."""
    from qpalette.fileio import atomic_write_json
    from qpalette.measure.bench import BenchOptions
    from qpalette.measure.bench import bench as run

    result = run(BenchOptions(model=model, **options), log=log)
    if json_out is not None:
        atomic_write_json(json_out, result)
    return result


def profile(model: str, batch_sizes: list[int] | None = None, output: str | Path = ".", *,
            entries: list[str] | None = None, dtype: str = "float16", constant: bool = True,
            name: str | None = None, resume: bool = False, log: Log = _quiet) -> list[Path]:
    """Measure this GPU's latency profile(s) for `plan` (one file per batch size); their paths.
    `resume` continues a killed run from what it saved."""
    from qpalette.measure.profile import run_profile
    from qpalette.quant.palette import get_quantizer

    entries = [get_quantizer(e).name for e in entries] if entries else None
    return run_profile(model, batch_sizes, output, entries, dtype, constant, name, resume=resume, say=log)
