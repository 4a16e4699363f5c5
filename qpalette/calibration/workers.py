"""Multi-device calibration: one spawned process per device, layers dealt round-robin.

Each worker loads its own copy of the model, reads the evaluation tokens from the resume file,
runs `sensitivity.run_layers` on its share (advancing its own block cache) and reports through a
queue: ("tick", rank) per evaluation, ("layer", rank, name, delta_kl, seconds) per layer,
("done", rank) or ("error", rank, message).
"""

from __future__ import annotations

import queue as queue_mod
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from qpalette.devices import resolve_dtype
from qpalette.errors import CalibrationError

POLL_S = 5


def run_on_devices(devices: list[str], model_dir: Path, tokens_path: Path, todo: list[str], settings,
                   report: Callable[[str, list[float], float], None], tick: Callable[[], None]) -> None:
    """Measure the layers in `todo` on every device at once; report(name, dkl, seconds) per layer."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for rank, dev in enumerate(devices):
        shard = todo[rank::len(devices)]
        if shard:
            p = ctx.Process(target=_worker, daemon=True,
                            args=(rank, dev, str(model_dir), str(tokens_path), shard, asdict(settings), q))
            p.start()
            procs.append(p)
    try:
        _collect(q, procs, devices, report, tick)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)


def _collect(q, procs, devices, report, tick) -> None:
    """Hand the workers' messages on until every worker is done; a failure raises."""
    running = len(procs)
    while running:
        try:
            msg = q.get(timeout=POLL_S)
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                raise CalibrationError("a calibration worker died without reporting (out of memory?)")
            continue
        kind = msg[0]
        if kind == "tick":
            tick()
        elif kind == "layer":
            report(msg[2], msg[3], msg[4])
        elif kind == "done":
            running -= 1
        elif kind == "error":
            raise CalibrationError(f"worker on {devices[msg[1]]} failed: {msg[2]}")


def _worker(rank: int, device: str, model_dir: str, tokens_file: str, todo: list[str],
            settings: dict, queue) -> None:
    """Process entry point for one device."""
    try:
        from safetensors.torch import load_file

        from qpalette.calibration.noise import Settings, run_layers
        from qpalette.runtime.loading import load_model

        torch.manual_seed(0)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        st = Settings(**settings)
        model, _tok = load_model(Path(model_dir), dev, resolve_dtype(st.dtype, dev, auto_cuda="tf32"))
        tokens = load_file(tokens_file)["tokens"]
        run_layers(model, tokens, todo, st, dev,
                   report=lambda n, d, s: queue.put(("layer", rank, n, d, s)),
                   tick=lambda: queue.put(("tick", rank)))
        queue.put(("done", rank))
    except BaseException as e:  # reported to the parent, which raises it
        queue.put(("error", rank, f"{type(e).__name__}: {e}"))
