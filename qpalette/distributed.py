"""Work spread over several devices: one process per device in a torch.distributed group.

Two ways in, one code path:
- the command spreads itself (`--devices cuda:0,cuda:1`, `cpu,cpu` in tests): `spawn` starts one
  process per device through torch.multiprocessing and joins them;
- torchrun starts the processes (one per GPU, on one machine or several; see docs/distributed.md)
  and `from_torchrun` reads the group from its environment.

The ranks only exchange small Python objects (which shards or layers are done, their results), so
the group always runs gloo, on CPUs and GPUs alike; the heavy tensors never leave their device.
A rank that fails stops the others: torch.multiprocessing's join and torchrun's agent both kill
the remaining processes. A user error on any rank (a `QpaletteError`) reaches the caller as the
same error class and message, without a traceback.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from qpalette import errors
from qpalette.errors import QpaletteError

# How long a rank may wait for the others at one exchange: at compress's last one, a finished rank
# waits for the slowest rank's whole share (hours of trellis coding on a CPU). A rank that dies does
# not leave the others waiting: the spawning command's join and torchrun's agent stop them.
TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Group:
    """This process's place among the ranks; `world` 1 is a run on one device."""

    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, items: list) -> list:
        """This rank's contiguous part of `items` (the parts differ in length by one at most)."""
        n = len(items)
        return items[self.rank * n // self.world:(self.rank + 1) * n // self.world]


def _claim(device: torch.device) -> torch.device:
    """`device` made this process's current one, CUDA initialised on it (its memory statistics
    exist only then); a bare "cuda" becomes the current GPU's index."""
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.cuda.init()
    return device


def solo(device: torch.device) -> Group:
    """One device, the whole run."""
    return Group(0, 1, _claim(device))


def resolve_model_in_turn(group: Group, model: str, quiet: bool = False) -> Path:
    """The model's local folder: rank 0 fetches or converts it first, the other ranks then find it
    in their cache (on another machine, they fetch it themselves) — never several at once."""
    from qpalette.models.sources import resolve_model

    model_dir = resolve_model(model, quiet=quiet) if group.main else None
    group.broadcast(None)
    return model_dir or resolve_model(model, quiet=True)


def log_to_stderr(message: str) -> None:
    """The log of a spawned rank (the caller's own function cannot be sent to another process)."""
    print(message, file=sys.stderr, flush=True)


def check_devices(devices: list[torch.device], error: type[QpaletteError]) -> None:
    """Several devices must be of one kind and each named once (cuda:0,cuda:1; cpu,cpu)."""
    if len(devices) < 2:
        return
    if len({d.type for d in devices}) > 1:
        raise error(f"devices {','.join(map(str, devices))}: give devices of one kind (cuda:0,cuda:1 or cpu,cpu)")
    cuda = [d for d in devices if d.type == "cuda"]
    if any(d.index is None for d in cuda) or len({d.index for d in cuda}) < len(cuda):
        raise error(f"devices {','.join(map(str, devices))}: name each GPU once, with its index (cuda:0,cuda:1)")


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


def from_torchrun(device_kind: str) -> Group:
    """The group torchrun started this process in; its device is cuda:LOCAL_RANK (or the CPU when
    `device_kind` is "cpu" or no GPU is visible)."""
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if not device_kind.startswith("cpu") and torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise QpaletteError(f"torchrun started local rank {local}, but only {torch.cuda.device_count()} GPU(s) "
                                "are visible: one process per GPU (--nproc-per-node)")
        device = _claim(torch.device(f"cuda:{local}"))
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return Group(rank, world, device)


def finish(group: Group) -> None:
    """The end of a rank's work under torchrun: wait for every rank, then take the process group
    down. A process that exits with the group up, or takes it down while another rank still talks
    to it, can abort in gloo's threads ("terminate called without an active exception")."""
    if group.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable, devices: list[torch.device], *args) -> None:
    """Run fn(group, *args) in one new process per device and wait for all of them. A
    `QpaletteError` raised on a rank is raised here (first rank first); anything else propagates
    as torch.multiprocessing's exception, with the rank's traceback."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory(prefix="qpalette-group-") as tmp:
        store = Path(tmp) / "store"
        try:
            mp.spawn(_rank_main, args=(fn, [str(d) for d in devices], str(store), tmp, args),
                     nprocs=len(devices), join=True)
        except ProcessException:  # the rank join saw first may only have lost its peer: the cause wins
            _raise_reported(Path(tmp), len(devices))
            raise


def _rank_main(rank: int, fn: Callable, devices: list[str], store: str, tmp: str, args: tuple) -> None:
    device = _claim(torch.device(devices[rank]))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=len(devices),
                            timeout=TIMEOUT)
    try:
        fn(Group(rank, len(devices), device), *args)
        dist.barrier()  # every rank done before any takes the group down (see `finish`)
    except QpaletteError as e:  # a user error: reported to the parent, which raises it without a traceback
        Path(tmp, f"error-{rank}.json").write_text(json.dumps({"class": type(e).__name__, "message": str(e)}))
        raise SystemExit(2) from None
    finally:
        dist.destroy_process_group()


def _raise_reported(tmp: Path, world: int) -> None:
    for rank in range(world):
        f = tmp / f"error-{rank}.json"
        if f.is_file():
            err = json.loads(f.read_text())
            cls = getattr(errors, err["class"], QpaletteError)
            if not (isinstance(cls, type) and issubclass(cls, QpaletteError)) or cls is errors.InfeasibleBudget:
                cls = QpaletteError
            raise cls(err["message"]) from None
