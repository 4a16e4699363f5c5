"""The `qpalette` command line."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from qpalette import api
from qpalette.config import CalibrateConfig, CompressConfig, PlanConfig
from qpalette.errors import InputError, QpaletteError


class _Commands(TyperGroup):
    """Where every command's user-facing errors become one line and exit code 2 (130 when
    interrupted); anything else is a bug and keeps its traceback (exit code 1)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QpaletteError as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted; rerun the same command with --resume where it has one, to continue", 130)
        except BrokenPipeError:
            sys.stderr.close()  # output piped into `head`: stop quietly
        except OSError as e:
            fail(f"{e.filename or ''}: {e.strerror or e}")


app = typer.Typer(
    cls=_Commands,
    help="Mixed-scheme weight quantization for Hugging Face causal LMs: calibrate, plan, "
    "compress, run.",
    epilog="Exit codes: 0 done; 2 a user error (bad input, a damaged file, no GPU for a GPU command: one "
    "line, no traceback); 130 interrupted (rerun with --resume where the command has it); 1 a bug "
    "(with its traceback). Progress: a bar on a terminal, a line every 10% in a log file, none with --quiet.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        from qpalette.version import __version__

        typer.echo(f"qpalette {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print qpalette's version and exit."),
) -> None:
    """Mixed-scheme weight quantization for Hugging Face causal LMs."""


JSON_HELP = "Also write the result as JSON to this file ('-': to standard output, the text to stderr)."


def _say(json_out: Path | None):
    """Where a command's text goes: stderr when its JSON takes standard output."""
    return lambda m, nl=True: typer.echo(m, nl=nl, err=str(json_out) == "-")


def _write_json(json_out: Path | None, doc) -> None:
    """--json FILE, the same in every command: the result as JSON ('-': standard output)."""
    if json_out is None:
        return
    if str(json_out) == "-":
        json.dump(doc, sys.stdout, indent=1)
        typer.echo()
        return
    from qpalette.fileio import atomic_write_json

    atomic_write_json(json_out, doc)
    typer.echo(f"wrote {json_out}", err=True)


def fail(message: str, code: int = 2) -> None:
    """Print a user-facing error (no traceback) and exit."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


@app.command()
def palette(
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
    family: Optional[list[str]] = typer.Option(
        None, "--family", "-f", help="Only these families (nuq, vq, tcq, half-tcq); repeatable."
    ),
    measure: bool = typer.Option(
        False, "--measure", help="Measure now on a fresh Gaussian matrix instead of the shipped table."
    ),
    rows: int = typer.Option(1024, help="Rows of the Gaussian test matrix (with --measure)."),
    cols: int = typer.Option(1024, help="Columns of the Gaussian test matrix (with --measure)."),
    device: str = typer.Option("cpu", help="Device for --measure (cpu, cuda)."),
    seed: int = typer.Option(0, help="Seed of the test matrix (with --measure)."),
    write: Optional[Path] = typer.Option(None, help="Write the measured table to this JSON file."),
) -> None:
    """List the quantizer palette with its distortion on Gaussian data vs the 2^(-2b) bound.

    Examples:

      qpalette palette

      qpalette palette --family tcq --json -
    """
    rows_out = api.palette(tuple(f.lower() for f in family) if family else None, measure=measure, rows=rows,
                           cols=cols, device=device, seed=seed, write=write,
                           log=lambda m: typer.echo(m, err=True))
    say = _say(json_out)
    say(f"{'entry':>14} {'bits':>5} {'nmse':>9} {'2^-2b':>9} {'gap dB':>7}")
    for r in rows_out:
        say(f"{r.name:>14} {r.bits:5.2f} {r.nmse:9.5f} {r.rd_bound:9.5f} {r.gap_db:7.2f}")
    _write_json(json_out, [asdict(r) for r in rows_out])


def _patterns(values: list[str] | None) -> list[str] | None:
    """--ignore's patterns: None when not given (the defaults), [] for a lone empty one (nothing)."""
    if not values:
        return None
    return [v for v in values if v]


@app.command()
def calibrate(
    model: str = typer.Argument(
        ..., help="Local HF model dir, HF hub id, .gguf/.whl file, or the embedded 'smollm2-135m'."
    ),
    output: Path = typer.Option(Path("sens.json"), "--output", "-o", help="Sensitivity JSON to write."),
    num_seqs: int = typer.Option(256, "--num-seqs", "-n", help="Evaluation sequences."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sequence (256×512 = 128K tokens)."),
    dataset: Optional[str] = typer.Option(
        None, help="Data-aware: a `datasets` NAME[:CONFIG[:SPLIT]], e.g. wikitext:wikitext-2-raw-v1:test."
    ),
    text_file: Optional[Path] = typer.Option(None, "--text-file", help="Data-aware: a UTF-8 text file."),
    levels: int = typer.Option(CalibrateConfig.levels, help="Noise levels t = i/levels, i = 1..levels."),
    t_max: float = typer.Option(1.0, "--t-max", help="Largest noise level (noise norm / weight norm)."),
    directions: str = typer.Option(
        "shared", help="shared: one noise direction per layer scaled over the levels; fresh: one per level."
    ),
    loss: str = typer.Option(
        "auto", help="auto: KL to the original on its own samples (data-free), next-token cross-entropy "
        "on the text (data-aware); kl; ce."
    ),
    seed: int = typer.Option(0, help="Seed of the sampled sequences and of the noise."),
    device: str = typer.Option(
        "auto", help="auto (all GPUs, else CPU), cpu, cuda, cuda:0,cuda:1 ...: a whole copy of the model on each, "
        "one process each (or under torchrun: docs/distributed.md)."
    ),
    max_memory: Optional[str] = typer.Option(
        None, "--max-memory", help="Weights one device may hold (e.g. 20GiB; on a GPU also at most 75% of its free "
        "memory): a model larger than that is split over the --device list, in one process."
    ),
    batch_size: int = typer.Option(0, "--batch-size", help="Sequences per forward pass (0: automatic)."),
    dtype: str = typer.Option("auto", help="auto (cpu float32, cuda bfloat16), float32, tf32, bfloat16, float16."),
    layers: Optional[str] = typer.Option(None, help="Only layers whose name matches this regex."),
    targets: Optional[list[str]] = typer.Option(
        None, "--targets", help="Regular expression of layer names to quantize (repeatable; default: every "
        "linear layer of the decoder blocks)."
    ),
    ignore: Optional[list[str]] = typer.Option(
        None, "--ignore", help="Regular expression of layer names to leave 16-bit (repeatable; default: MoE "
        "routers). --ignore '' ignores nothing."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run of OUTPUT."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Per-layer sensitivity a_l, the coefficients of Loss(Q(W)) − Loss(W) ≈ Σ a_l·err_l that `plan`
    minimises: each layer's weight is perturbed by noise of growing size and the loss increase is
    fitted against it.

    Examples:

      qpalette calibrate smollm2-135m -o sens.json

      qpalette calibrate MODEL_DIR --text-file calib.txt -o sens.json --device cuda --resume

      qpalette calibrate MODEL_DIR -o sens.json --device cuda:0,cuda:1 --max-memory 70GiB
    """
    config = CalibrateConfig(num_seqs=num_seqs, seq_len=seq_len, levels=levels, t_max=t_max, directions=directions,
                             loss=loss, seed=seed, dataset=dataset, text_file=str(text_file) if text_file else None,
                             layers=layers, targets=targets or None, ignore=_patterns(ignore), batch_size=batch_size,
                             dtype=dtype)
    doc = api.calibrate(model, output, config, devices=device, max_memory=max_memory, resume=resume,
                        progress=not quiet, log=lambda m: typer.echo(m, err=True))
    if doc is None:  # a rank other than 0 under torchrun: rank 0 reports
        return
    t = doc["timing"]
    _say(json_out)(
        f"{doc['n_layers']} layers, {doc['tokens']} tokens ({doc['protocol']}), median R² "
        f"{doc['median_r2']:.4f}, {t['total_s']:.1f} s on {','.join(t['devices'])} → {output}"
    )
    _write_json(json_out, doc)


@app.command()
def hessians(
    model: str = typer.Argument(
        ..., help="Local HF model dir (safetensors), HF hub id, .gguf/.whl file, or 'smollm2-135m'."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Folder to write the Hessians to."),
    text_file: Optional[Path] = typer.Option(None, "--text-file", help="Calibration text: a UTF-8 text file."),
    dataset: Optional[str] = typer.Option(
        None, help="Calibration text: a `datasets` NAME[:CONFIG[:SPLIT]], e.g. wikitext2."
    ),
    tokens: int = typer.Option(
        0, "--tokens", help="Calibration tokens (0: 262144 on a GPU, 32768 on the CPU; an 8B model on a "
        "GPU takes the default, on a CPU use 32768 or fewer)."
    ),
    seq_len: int = typer.Option(0, "--seq-len", help="Tokens per window (0: 2048, or the model's context)."),
    batch_size: int = typer.Option(
        0, "--batch-size", help="Windows per forward pass (0: 16K tokens on a GPU, 4K on the CPU)."
    ),
    device: str = typer.Option("auto", help="auto (GPU if present), cpu, cuda, cuda:1."),
    resume: bool = typer.Option(False, "--resume", help="Finish an interrupted run into the same folder."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Input second moments H = XᵀX/n of every quantized layer on calibration text, one block at a
    time, for `compress --hessians` (data-aware rounding: LDLQ feeds each column's rounding
    error forward, lowering the layer's output error on that text)."""
    doc = api.hessians(
        model, output, text_file=str(text_file) if text_file else None, dataset=dataset, tokens=tokens,
        seq_len=seq_len, batch_size=batch_size, device=device, resume=resume, progress=not quiet,
        log=lambda m: typer.echo(m, err=True),
    )
    _say(json_out)(f"{len(doc['files'])} files, {doc['tokens']} tokens of {doc['source']}, {doc['seconds']:.1f} s "
                   f"on {doc['device']} → {output}")
    _write_json(json_out, doc)


@app.command("loss-table")
def loss_table(
    model: str = typer.Argument(
        ..., help="Local HF model dir (safetensors), HF hub id, .gguf/.whl file, or 'smollm2-135m'."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Loss table JSON to write."),
    text_file: Optional[Path] = typer.Option(None, "--text-file", help="Calibration text: a UTF-8 text file."),
    dataset: Optional[str] = typer.Option(
        None, help="Calibration text: a `datasets` NAME[:CONFIG[:SPLIT]], e.g. wikitext2."
    ),
    entries: Optional[str] = typer.Option(
        None, "--entries", help="Palette entries and/or families, comma list (default: the whole palette; "
        "on a CPU prefer nuq,vq: trellis entries take minutes a layer)."
    ),
    hessians: Optional[Path] = typer.Option(
        None, "--hessians", help="A folder from `qpalette hessians`: layers are rounded by LDLQ, as compress does."
    ),
    damp: float = typer.Option(0.01, "--damp", help="With --hessians: LDLQ damping, a fraction of mean diag(H)."),
    base: Optional[str] = typer.Option(
        None, "--base", help="Measure on top of every block layer quantized with this entry (default: on "
        "the unquantized model)."
    ),
    tokens: int = typer.Option(0, "--tokens", help="Calibration tokens (0: 131072 on a GPU, 8192 on the CPU)."),
    seq_len: int = typer.Option(0, "--seq-len", help="Tokens per window (0: 2048, or the model's context)."),
    batch_size: int = typer.Option(0, "--batch-size", help="Windows per forward pass (0: automatic)."),
    device: str = typer.Option("auto", help="auto (GPU if present), cpu, cuda, cuda:1 (one device)."),
    layers: Optional[str] = typer.Option(None, help="Only layers whose name matches this regex."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run, or extend OUTPUT."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Measured loss terms for `plan --loss-table`: the increase of the
    cross-entropy on calibration text with each layer alone quantized by each palette entry."""
    doc = api.loss_table(
        model, output, text_file=str(text_file) if text_file else None, dataset=dataset,
        entries=entries.split(",") if entries else None, hessians=str(hessians) if hessians else None,
        damp=damp, base=base, tokens=tokens, seq_len=seq_len, batch_size=batch_size, device=device,
        layers=layers, resume=resume, progress=not quiet, log=lambda m: typer.echo(m, err=True),
    )
    cells = sum(len(r) for r in doc["rows"].values())
    _say(json_out)(f"{cells} cells ({len(doc['rows'])} layers × {len(doc['entries'])} entries), {doc['tokens']} "
                   f"tokens of {doc['source']}, baseline loss {doc['base_loss']:.4f}, "
                   f"{doc['timing']['seconds']:.1f} s on {doc['timing']['device']} → {output}")
    _write_json(json_out, doc)


@app.command()
def plan(
    model: Optional[str] = typer.Argument(
        None, help="Local HF model directory or its config.json (omit: shapes from --sensitivity)."
    ),
    budget: Optional[list[str]] = typer.Option(
        None, "--budget", "-b", help="3.25bits | 2.4GB | 900MiB | 200tok/s | 5ms; repeat or "
        "comma-list to combine (all must hold)."
    ),
    sensitivity: Optional[Path] = typer.Option(None, "--sensitivity", "-s", help="calibrate's JSON."),
    loss_table: Optional[Path] = typer.Option(
        None, "--loss-table", help="`qpalette loss-table`'s JSON: minimise its measured losses instead of "
        "a_l·err(q) (then --sensitivity is optional)."
    ),
    latency_profile: Optional[Path] = typer.Option(
        None, "--latency-profile", "-l", help="qpalette.latency/1 JSON for tok/s or ms budgets (default: a shipped profile of "
        "the model's shapes, the one measured on this GPU when there is one)."
    ),
    distortion: Optional[Path] = typer.Option(
        None, help="Distortion table (default: the shipped measured one)."
    ),
    palette_: Optional[list[str]] = typer.Option(
        None, "--palette", "-p", help="Families (nuq, vq, tcq, half-tcq) and/or entries (`qpalette palette` "
        "lists them), e.g. tcq,half-tcq or tcq-2,vq-3.5."
    ),
    no_fuse: bool = typer.Option(False, "--no-fuse", help="No fused qkv / gate_up groups."),
    lm_head: str = typer.Option(
        "auto", "--lm-head", help="auto: quantize lm_head under a speed budget (when the sensitivity "
        "file and latency profile cover it), else keep it 16-bit; quantize; keep."
    ),
    batch_size: Optional[int] = typer.Option(None, help="Must match the latency profile's."),
    time_limit: float = typer.Option(60.0, help="SCIP time limit in seconds."),
    targets: Optional[list[str]] = typer.Option(
        None, "--targets", help="Regular expression of layer names to quantize (repeatable; default: every "
        "linear layer of the decoder blocks)."
    ),
    ignore: Optional[list[str]] = typer.Option(
        None, "--ignore", help="Regular expression of layer names to leave 16-bit (repeatable; default: MoE "
        "routers). --ignore '' ignores nothing."
    ),

    output: Path = typer.Option(Path("plan.json"), "--output", "-o"),
    plot: Optional[Path] = typer.Option(None, help="PNG of bits per layer (default: OUTPUT.png)."),
    no_plot: bool = typer.Option(False, "--no-plot"),
    show: Optional[Path] = typer.Option(None, "--show", help="Print a saved plan and exit."),
    blocks_only: bool = typer.Option(False, "--blocks", help="With --show: per-block table only."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Choose a quantizer per linear layer under a memory and/or speed budget (SCIP).

    Input paths may name the files shipped with qpalette as qpalette:profiles/NAME. Examples, on the
    paper's Llama-3.1-8B tables shipped in qpalette:profiles/reference (a 3.25-bit plan, a plan
    for 200 tok/s on an RTX 4090 within 5 GB, a saved plan shown again):

      qpalette plan qpalette:profiles/reference/llama31_8b -s qpalette:profiles/reference/llama31_8b_sensitivity.json -b 3.25bits

      qpalette plan qpalette:profiles/reference/llama31_8b -s qpalette:profiles/reference/llama31_8b_sensitivity.json -l qpalette:profiles/reference/rtx4090_latency_llama31_8b.json -b 200tok/s -b 5GB -o fast.json

      qpalette plan --show plan.json
    """
    say = _say(json_out)
    if show is not None:
        shown = api.load_plan(show)
        say(api.describe_plan(shown, blocks_only=blocks_only))
        _write_json(json_out, shown.to_dict())
        return
    if not budget:
        fail("give --budget (e.g. 3.25bits, 2.4GB, 200tok/s), or --show PLAN.json")
    png = None if no_plot else (plot or output.with_suffix(".png"))
    config = PlanConfig(budget=budget, palette=palette_, fuse=not no_fuse, batch_size=batch_size,
                        time_limit_s=time_limit, lm_head=lm_head, targets=targets or None, ignore=_patterns(ignore))
    p = api.plan(model, config=config, sensitivity=sensitivity, loss_table=loss_table,
                 latency_profile=latency_profile, distortion=distortion, output=output, plot=png)
    say(api.describe_plan(p, layers=False))
    say(f"wrote {output}" + (f" and {png}" if png else ""))
    _write_json(json_out, p.to_dict())


@app.command()
def compress(
    model: str = typer.Argument(
        ..., help="Local HF model dir (safetensors), HF hub id, .gguf/.whl file, or 'smollm2-135m'."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Folder to write the compressed model to."),
    plan_file: Optional[Path] = typer.Option(
        None, "--plan", "-p", help="A plan from `qpalette plan -o plan.json` (per-layer quantizers, fusion)."
    ),
    scheme: Optional[str] = typer.Option(
        None, "--scheme", "-s", help="One palette entry for every layer instead of a plan, e.g. tcq-3.0."
    ),
    fuse: bool = typer.Option(
        True, "--fuse/--no-fuse", help="Store fused groups (q/k/v, gate/up) as one matrix, one matmul."
    ),
    device: str = typer.Option(
        "auto", help="Where to quantize: auto (GPU if present), cpu, cuda, cuda:1; several (cuda:0,cuda:1): one "
        "process each, blocks shared out, the same checkpoint. Under torchrun: each rank's GPU."
    ),
    seed: int = typer.Option(0, help="Seed of the random sign vectors."),
    resume: bool = typer.Option(False, "--resume", help="Continue a killed run (OUTPUT.partial/)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing OUTPUT folder."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    lm_head: bool = typer.Option(
        False, "--lm-head", help="With --scheme: quantize lm_head too (a plan says for itself)."
    ),
    random_codes: bool = typer.Option(
        False, "--random-codes", hidden=True,
        help="Speed benchmarks of random-weight models only: random code words, no quantizing.",
    ),
    hessians: Optional[Path] = typer.Option(
        None, "--hessians", help="Data-aware: a folder from `qpalette hessians`; layers are rounded by LDLQ."
    ),
    damp: float = typer.Option(0.01, "--damp", help="With --hessians: LDLQ damping, a fraction of mean diag(H)."),
    targets: Optional[list[str]] = typer.Option(
        None, "--targets", help="Regular expression of layer names to quantize (repeatable; default: every "
        "linear layer of the decoder blocks)."
    ),
    ignore: Optional[list[str]] = typer.Option(
        None, "--ignore", help="Regular expression of layer names to leave 16-bit (repeatable; default: MoE "
        "routers; with --plan: the plan's). --ignore '' ignores nothing."
    ),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Rotate and quantize a model block by block into a checkpoint transformers loads
    (after `import qpalette`).

    Examples:

      qpalette compress smollm2-135m --plan plan.json -o smollm2-q

      qpalette compress MODEL_DIR --scheme tcq-3.0 -o MODEL_DIR-tcq3 --device cuda --resume

      qpalette compress MODEL_DIR --plan plan.json -o MODEL_DIR-q --device cuda:0,cuda:1

      torchrun --nproc-per-node 2 -m qpalette compress MODEL_DIR --plan plan.json -o MODEL_DIR-q
    """
    if (plan_file is None) == (scheme is None):
        fail("give exactly one of --plan PLAN.json or --scheme ENTRY (e.g. tcq-3.0)")
    config = CompressConfig(fuse=fuse, sign_seed=seed, lm_head=lm_head, damp=damp, targets=targets or None,
                            ignore=_patterns(ignore))
    rep = api.compress(model, plan_file or scheme, output, config, device=device, hessians=hessians, resume=resume,
                       overwrite=overwrite, quiet=quiet, random_codes=random_codes,
                       log=lambda m: typer.echo(m, err=True))
    if rep is None:  # a torchrun rank other than 0: rank 0 reports
        return
    by = rep["bytes"]
    say = _say(json_out)
    say(
        f"wrote {output}: {by['total'] / 1e6:.2f} MB of tensors, {rep['avg_bits']:.3f} bits on "
        f"average, {rep['wall_time_s']:.1f} s on {rep['device']}"
    )
    if rep.get("plan_predicted_bytes"):
        say("tensor bytes equal the plan's prediction")
    say(
        "load it with:  import qpalette; AutoModelForCausalLM.from_pretrained(...)  (without "
        "`import qpalette` transformers refuses its model type)"
    )
    _write_json(json_out, rep)


@app.command("eval")
def eval_(
    model: str = typer.Argument(
        ..., help="Local HF model dir (original or compressed), HF hub id, .gguf/.whl file, or "
        "the embedded 'smollm2-135m'."
    ),
    dataset: str | None = typer.Option(
        None, help="Perplexity on a `datasets` test split: wikitext2 (the default when neither "
        "--text-file nor --kl-to is given; needs the hub)."
    ),
    text_file: Path | None = typer.Option(
        None, "--text-file", help="Perplexity on a local UTF-8 text file (read as is)."
    ),
    ctx: int = typer.Option(2048, "--ctx", help="Tokens per non-overlapping perplexity window."),
    max_windows: int | None = typer.Option(
        None, "--max-windows", help="Score only the first N windows (default: all)."
    ),
    batch_size: int = typer.Option(1, "--batch-size", help="Windows per forward pass."),
    kl_to: str | None = typer.Option(
        None, "--kl-to", help="Reference model (e.g. the FP16 original): data-free mean KL(ref ‖ model) "
        "on sequences sampled from the reference."
    ),
    kl_seqs: int = typer.Option(32, "--kl-seqs", help="Sequences sampled from the reference for --kl-to."),
    kl_len: int = typer.Option(512, "--kl-len", help="Tokens per sampled sequence (BOS included)."),
    seed: int = typer.Option(0, help="Seed of the sampled sequences."),
    device: str = typer.Option("auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N."),
    dtype: str = typer.Option("auto", help="auto (cpu float32, cuda float16), float32, float16, bfloat16."),
    json_out: Path | None = typer.Option(None, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Perplexity over non-overlapping --ctx windows (GPTQ protocol) and/or data-free KL to a reference.

    Examples:

      qpalette eval smollm2-135m --dataset wikitext2 --ctx 2048

      qpalette eval compressed_dir --text-file wiki.test.raw --kl-to smollm2-135m --json eval.json
    """
    result = api.evaluate(
        model, dataset=dataset, text_file=str(text_file) if text_file else None, ctx=ctx,
        max_windows=max_windows, batch_size=batch_size, kl_to=kl_to, kl_seqs=kl_seqs, kl_len=kl_len,
        seed=seed, device=device, dtype=dtype, progress=not quiet, log=_say(json_out),
    )
    _write_json(json_out, result)


@app.command()
def generate(
    model: str = typer.Argument(
        ..., help="Local HF model dir (original or compressed), .gguf/.whl file, or 'smollm2-135m'."
    ),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch of prompts."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the tokenizer's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most new tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 is greedy; above 0 samples from softmax(logits/T)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample only from the smallest set of tokens with this mass."),
    top_k: int = typer.Option(0, "--top-k", help="Sample only from the k most likely tokens (0: all)."),
    seed: int = typer.Option(0, help="Seed of the sampling noise: the same seed gives the same text."),
    batch: int = typer.Option(1, "--batch", "-b", help="Run every prompt this many times (samples differ)."),
    device: str = typer.Option("auto", help="auto (cuda if available), cpu, cuda, cuda:N."),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="Replay decode steps as CUDA graphs (on a GPU)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Generate text with qpalette's decoder: static KV cache, decode steps replayed as CUDA graphs,
    the next token chosen on the GPU. Works for original and compressed models alike; one prompt
    streams to the terminal as it is generated; timings go to stderr.

    Examples:

      qpalette generate smollm2-q -p "What is the capital of France?" --chat -n 64

      qpalette generate smollm2-135m -p "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1 --batch 4
    """
    if batch < 1:
        fail("--batch must be ≥ 1")
    prompts = [p for p in prompt for _ in range(batch)]
    stream = len(prompts) == 1

    say = _say(json_out)

    def show(i: int, piece: str) -> None:
        say(piece, nl=False)

    out = api.generate(model, None, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, chat=chat, device=device, on_text=show if stream else None,
                       graphs=graphs)
    if stream:
        say("")
    else:
        for i, text in enumerate(out.texts):
            say(f"--- {i}: {prompts[i]!r}\n{text}")
    r = out.result
    typer.echo(f"prefill {r.prefill_s * 1e3:.1f} ms; {r.steps} decode steps at {r.decode_tok_per_s:.1f} tok/s per "
               f"sequence ({r.decode_tok_per_s * len(prompts):.1f} total); host {r.host_step_s * 1e3:.3f} ms a step; "
               f"CUDA graphs {'on' if r.graphs else 'off'}", err=True)
    _write_json(json_out, {"format": "qpalette.generate/1", "prompts": prompts, "texts": out.texts,
                           "tokens": out.tokens, "finished": r.finished, "prefill_s": r.prefill_s,
                           "decode_s": r.decode_s, "steps": r.steps, "host_step_s": r.host_step_s,
                           "cuda_graphs": r.graphs})


@app.command()
def bench(
    model: str = typer.Argument(
        ..., help="Local HF model dir (original or compressed), .gguf/.whl file, or 'smollm2-135m'."
    ),
    batch_sizes: str = typer.Option("1,8", "--batch-sizes", help="Comma-separated decode batch sizes."),
    prompt_len: int = typer.Option(64, "--prompt-len", help="Random prompt tokens per sequence."),
    gen_len: int = typer.Option(128, "--gen-len", help="Generated tokens per sequence (steps timed)."),
    device: str = typer.Option("auto", help="auto (cuda if available), cpu, cuda, cuda:N."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile + CUDA graphs (GPU)."),
    compile_modes: str = typer.Option(
        "default", "--compile-modes",
        help="How generate and the loop compile: default (transformers' reduce-overhead), lean (without "
        "dynamo's guards on module state), deferred (lean, and generate checks for the end one step late "
        "on CUDA, so the host no longer waits for the GPU every token), plain (model.generate as a user calls "
        "it: a qpalette model defers its stop check by itself, an original model does not), or several: "
        "default,deferred,plain.",
    ),
    ways: str = typer.Option(
        "decoder,generate,loop", "--ways",
        help="Which ways to time (comma list): decoder (qpalette's), generate (transformers'), loop (the "
        "compiled forward alone).",
    ),
    attention: str = typer.Option(
        "qpalette", "--attention",
        help="qpalette (decode attention on the cache as it is, query heads packed per KV head) or sdpa "
        "(transformers' own, which copies the cache to every query head), to compare.",
    ),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Decode tokens/s three ways, side by side: qpalette's decoder (what `qpalette generate`
    runs), transformers' generate (static cache, compiled) and the compiled forward loop (the
    GPU's time per token). The same harness for original and compressed models."""
    modes = tuple(m.strip() for m in compile_modes.split(",") if m.strip())
    result = api.bench(model, batch_sizes=tuple(_int_list(batch_sizes, "--batch-sizes")), prompt_len=prompt_len,
                       gen_len=gen_len, device=device, compile=compile, compile_modes=modes,
                       ways=tuple(w.strip() for w in ways.split(",") if w.strip()), attention=attention,
                       log=_say(json_out))
    _write_json(json_out, result)


@app.command()
def profile(
    model: str = typer.Argument(
        ..., help="Local HF model dir or config.json (only the shapes are used), or 'smollm2-135m'."
    ),
    batch_sizes: str = typer.Option("1,8", "--batch-sizes", help="Comma-separated decode batch sizes."),
    output: Path = typer.Option(Path("."), "--output", "-o", help="Folder for the latency JSON files."),
    palette: Optional[str] = typer.Option(None, "--palette", "-p", help="Only these entries (comma list)."),
    dtype: str = typer.Option("float16", help="Activation dtype: float16 or bfloat16."),
    constant: bool = typer.Option(True, "--constant/--no-constant",
                                  help="Also measure the per-token overhead outside the linear layers."),
    name: Optional[str] = typer.Option(None, help="Model name recorded in the profile."),
    resume: bool = typer.Option(False, "--resume", help="Continue a killed run (what it measured is kept)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Measure this GPU's kernel latency for every fusion group shape × palette entry × batch size
    the model needs (plus the constant per-token overhead) into profiles `qpalette plan` reads."""
    if dtype not in ("float16", "bfloat16"):
        fail("--dtype must be float16 or bfloat16")
    entries = palette.split(",") if palette else None
    paths = api.profile(model, _int_list(batch_sizes, "--batch-sizes"), output, entries=entries, dtype=dtype,
                        constant=constant, name=name, resume=resume,
                        log=(lambda m: None) if quiet else (lambda m: typer.echo(m, err=True)))
    for p in paths:
        _say(json_out)(f"wrote {p}")
    _write_json(json_out, [str(p) for p in paths])


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option} {text!r}: expected integers like 1,8") from None


if __name__ == "__main__":
    app()
