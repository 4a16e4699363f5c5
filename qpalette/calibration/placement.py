"""Where a calibration runs when it is given several devices: one whole copy of the model per
device (replicas, one process each: `calibration.sensitivity`), or, when the weights do not fit one
device, one process with the model split block by block over the devices (accelerate's dispatch
through transformers' `device_map`).

The weights are counted on a meta-device copy of the model, before anything is loaded, and packed
in model order: the embedding (and everything else before block 0), the decoder blocks, then the
final norm and lm_head (with the embedding when the head is tied to it); a block is never cut.
A device's budget is `--max-memory` (per device) and, on a GPU, WEIGHT_FRACTION of its free
memory: the rest is for the evaluator's caches (block inputs, reference log-probs, logits).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from qpalette.errors import CalibrationError, ModelError

WEIGHT_FRACTION = 0.75  # of a GPU's free memory, for the weights


@dataclass(frozen=True)
class Unit:
    """Modules that go to one device together (module names of the loaded model) and their bytes."""

    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class Split:
    """The device (index into the device list) of every unit, in model order."""

    units: list[Unit]
    where: list[int]

    def device_map(self, devices: list[str]) -> dict[str, str]:
        """transformers' `device_map`: module name → device."""
        return {name: devices[d] for unit, d in zip(self.units, self.where) for name in unit.names}


def model_units(model_dir: Path, dtype: torch.dtype) -> list[Unit]:
    """The model's units in model order, their weights counted in `dtype` (floating tensors; the
    others as stored): [before block 0 (+ norm and head when tied), block 0, ..., norm + head]."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qpalette.calibration.evaluator import decoder_blocks
    from qpalette.models.experts import unfuse_experts

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = unfuse_experts(AutoModelForCausalLM.from_config(config))
    except Exception as e:  # noqa: BLE001 — transformers raises many kinds for a config it cannot build
        raise ModelError(f"cannot build the model of {model_dir} to size it: {str(e).splitlines()[0][:200]}") from None
    blocks = decoder_blocks(model)
    base = model.model
    prefix = next(n for n, m in model.named_modules() if m is base)
    tied = model.lm_head.weight is model.get_input_embeddings().weight

    def size(module: torch.nn.Module, seen: set) -> int:
        total = 0
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
        return total

    seen: set = set()
    head_names = (f"{prefix}.norm", "lm_head")
    before = [(f"{prefix}.{n}", m) for n, m in base.named_children() if n not in ("layers", "norm")]
    before += [(n, m) for n, m in model.named_children() if m is not base and n != "lm_head"]
    first = Unit(tuple(n for n, _m in before), sum(size(m, seen) for _n, m in before))
    block_units = [Unit((f"{prefix}.layers.{j}",), size(b, seen)) for j, b in enumerate(blocks)]
    head = Unit(head_names, size(base.norm, seen) + size(model.lm_head, seen))
    if tied:  # the head shares the embedding's weight: the same device
        return [Unit(first.names + head_names, first.nbytes + head.nbytes), *block_units]
    return [first, *block_units, head]


def device_budgets(devices: list[torch.device], max_memory: int | None) -> list[int | None]:
    """Bytes of weights each device may hold: `max_memory`, and on a GPU at most WEIGHT_FRACTION
    of its free memory; None: no limit (a CPU without --max-memory)."""
    gpus = [d for d in devices if d.type == "cuda"]
    free = dict(zip(gpus, free_gpu_bytes(gpus))) if gpus else {}
    out = []
    for dev in devices:
        budget = max_memory
        if dev.type == "cuda":
            budget = min(int(free[dev] * WEIGHT_FRACTION), budget if budget is not None else free[dev])
        out.append(budget)
    return out


FREE_BYTES_CODE = "import json, sys, torch; print(json.dumps([torch.cuda.mem_get_info(int(i))[0] for i in sys.argv[1:]]))"


def free_gpu_bytes(gpus: list[torch.device]) -> list[int]:
    """Free memory of each GPU. With several GPUs and no CUDA context in this process yet, a
    short-lived child process asks: cudaMemGetInfo would open a context on every GPU (about
    0.5 GB each, measured on 2×H200) that this process, which only starts the ranks, would then
    hold for the whole run. Where the child cannot answer, this process asks itself."""
    if len(gpus) > 1 and not torch.cuda.is_initialized():
        try:
            res = subprocess.run([sys.executable, "-c", FREE_BYTES_CODE, *(str(d.index) for d in gpus)],
                                 capture_output=True, text=True, timeout=300, check=True)
            free = json.loads(res.stdout.strip().splitlines()[-1])
            if len(free) == len(gpus):
                return [int(f) for f in free]
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return [torch.cuda.mem_get_info(d)[0] for d in gpus]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def place(units: list[Unit], budgets: list[int | None], devices: list[str]) -> Split | None:
    """None when the whole model fits every device (one copy on each); else the units packed in
    order over the devices (each filled before the next). CalibrationError when it fits no way."""
    total = sum(u.nbytes for u in units)
    if all(b is None or total <= b for b in budgets):
        return None
    where, d, used = [], 0, 0
    for u in units:
        while d < len(budgets) and budgets[d] is not None and used + u.nbytes > budgets[d]:
            d, used = d + 1, 0
        if d == len(budgets):
            break
        where.append(d)
        used += u.nbytes
    room = [gib(b) if b is not None else "no limit" for b in budgets]
    if len(budgets) == 1:
        raise CalibrationError(
            f"the model's weights ({gib(total)}) do not fit on {devices[0]} (room for {room[0]} of weights: "
            f"--max-memory, and {WEIGHT_FRACTION:.0%} of a GPU's free memory); give several devices "
            "(--device cuda:0,cuda:1) to split it over them, or a smaller --dtype")
    if len(where) < len(units):
        biggest = max(u.nbytes for u in units)
        raise CalibrationError(
            f"the model's weights ({gib(total)}; its largest block {gib(biggest)}) do not fit even split over "
            f"{len(devices)} devices (room for weights: "
            + ", ".join(f"{dev} {r}" for dev, r in zip(devices, room)) + "); add devices, raise --max-memory or use "
            "a smaller --dtype")
    return Split(units, where)
