"""The `qpalette` command line."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    help="Mixed-scheme weight quantization for Hugging Face causal LMs: calibrate, plan, "
    "compress, run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Mixed-scheme weight quantization for Hugging Face causal LMs."""


def fail(message: str, code: int = 2) -> None:
    """Print a user-facing error (no traceback) and exit."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


@app.command()
def palette(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
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
    """List the quantizer palette with its distortion on Gaussian data vs the 2^(-2b) bound."""
    from .codebooks import CodebookError
    from .distortion import measure_all, shipped_table, write_table
    from .palette import FAMILIES, palette_entries
    from .tiles import UnsupportedShape

    fams = tuple(f.lower() for f in family) if family else None
    if fams and set(fams) - set(FAMILIES):
        fail(f"unknown family {sorted(set(fams) - set(FAMILIES))}; choose from {', '.join(FAMILIES)}")
    entries = palette_entries(fams)
    try:
        if measure:
            if device.startswith("cuda"):
                import torch

                if not torch.cuda.is_available():
                    fail("--device cuda asked for, but no CUDA GPU is visible")
            progress = None if as_json else (
                lambda r: typer.echo(f"  measured {r.name:>14}  nmse {r.nmse:.5f}", err=True)
            )
            rows_out, how = measure_all(entries, rows, cols, seed, device, progress)
            if write:
                write_table(rows_out, write, how)
        else:
            table = shipped_table()
            rows_out = [table[q.name] for q in entries if q.name in table]
    except (CodebookError, UnsupportedShape, FileNotFoundError) as e:
        fail(str(e))
    if as_json:
        json.dump([asdict(r) for r in rows_out], sys.stdout, indent=1)
        typer.echo()
        return
    typer.echo(f"{'entry':>14} {'bits':>5} {'nmse':>9} {'2^-2b':>9} {'gap dB':>7}")
    for r in rows_out:
        typer.echo(f"{r.name:>14} {r.bits:5.2f} {r.nmse:9.5f} {r.rd_bound:9.5f} {r.gap_db:7.2f}")


if __name__ == "__main__":
    app()
