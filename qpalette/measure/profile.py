"""`qpalette profile MODEL`: measure a latency profile (`qpalette.latency/1`) on the local GPU.

For every fusion group of one block (q k v o gate up down qk kv qv qkv gateup; the groups'
matrices are the row-concatenated layers) and lm_head (group `head`) and every palette entry, the time of one
`ops.quantized_matmul` call at each batch size (qpalette.kernel_timing: CUDA-graph replay,
weights cycled through enough copies to defeat L2). Groups of equal shape are measured once.

The constant per-step overhead (`constant_s`) is what a decode step costs outside the quantized
matmuls, measured inside a model: the model of the config with random weights and every block's
linear layer ANCHOR (tcq-2.0, random codes, fused as `compress` fuses), timed in `qpalette bench`'s
forward loop (compiled, CUDA graphs, static cache: the GPU's time per token), minus the isolated
times of its matmuls measured like the groups. It therefore holds the online rotations as the
runtime runs them (fused into the matmul at batch 1), attention, norms, the 16-bit lm_head, and
the gaps between kernels inside a model that isolated kernel times miss. Its blocks count as
unfused: where the runtime runs a block's adds and norms inside its kernels (its GEMVs at batch 1,
its rotation kernels at batch 2–8), the same model is timed with every layer's own forward too, and
`fused_block_saving_s` (a block) is what a plan subtracts for each block that fuses
(`planning.program.fused_blocks`). The same model with
lm_head quantized too gives `constant_quantized_head_s`, which a plan that quantizes the head uses
(`LatencyProfile.with_quantized_head`). Predictions made from a profile are forward-loop tok/s;
transformers' `generate` adds its per-token host work on top (`qpalette bench` reports both). The
FP16 model's step and the isolated FP16 linear, rotation and head times are kept in `constant`
for reports.

Entry point for the CLI: `run_profile(model, batch_sizes, out_dir, ...)` → paths written.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qpalette.errors import InputError, KernelError, UnsupportedShape
from qpalette.fileio import atomic_write, output_lock, read_json_object
from qpalette.measure import timing as kernel_timing
from qpalette.models import topology as architecture
from qpalette.models.experts import is_expert_layer
from qpalette.models.topology import GROUPS
from qpalette.planning.inputs import LATENCY_FORMAT
from qpalette.planning.program import takes_block_fusion
from qpalette.quant.palette import PALETTE, get_quantizer

PARTIAL_FORMAT = "qpalette.latency-partial/1"
ANCHOR = "tcq-2.0"  # the entry of the quantized model whose measured step anchors constant_s


def load_model_config(model: str) -> tuple[dict, str]:
    """config.json dict of MODEL (a model dir, a config.json file, or anything resolve_model takes)."""
    p = Path(model).expanduser()
    if p.is_file() and p.name.endswith(".json"):
        return architecture.load_config(p), str(p)
    if p.is_dir() and (p / "config.json").is_file():
        return architecture.load_config(p / "config.json"), str(p)
    from qpalette.models.sources import resolve_model

    d = resolve_model(model)
    return architecture.load_config(Path(d) / "config.json"), str(d)


def group_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of every fusion group's matrix in block 0 (the first module holding its layers:
    one expert stands for all of a block's), and of lm_head (group `head`)."""
    layers = [l for l in architecture.linear_layers(cfg, lm_head=True) if l.block == 0 or l.kind == "head"]
    parents = [kinds for blk in architecture.units(layers).values() for kinds in blk.values()]
    out = {}
    for g in list(GROUPS) + [l.kind for l in layers if l.kind not in GROUPS]:
        for kinds in parents:
            members = architecture.group_members(g, kinds)
            if members is not None and g not in out:
                rows = sum(layers[kinds[k]].out_features for k in members)
                cols = {layers[kinds[k]].in_features for k in members}
                assert len(cols) == 1, f"group {g} mixes input sizes"
                out[g] = (rows, cols.pop())
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_groups(shapes: dict[str, tuple[int, int]], entries: list[str], batch_sizes: list[int],
                   dtype: torch.dtype, say=_say, run: PartialProfile | None = None) -> dict[int, dict[str, dict[str, float]]]:
    """{batch: {group: {entry: seconds}}}; each distinct shape measured once, and saved in `run`
    (which skips the shapes an interrupted run measured already)."""
    by_shape: dict[tuple[int, int], dict[str, dict[int, float]]] = {}
    for shape in dict.fromkeys(shapes.values()):
        rows, cols = shape
        if run is not None and run.has_shape(shape):
            by_shape[shape] = run.shape(shape)
            continue
        by_shape[shape] = {}
        t0 = time.time()
        for name in entries:
            try:
                get_quantizer(name).check_shape(rows, cols)
            except UnsupportedShape as e:
                say(f"  {name} skipped on {rows}x{cols}: {e}")
                continue
            by_shape[shape][name], _ = kernel_timing.time_quantized(name, rows, cols, batch_sizes, dtype)
        say(f"  {rows}x{cols}: {len(by_shape[shape])} entries in {time.time() - t0:.1f} s")
        if run is not None:
            run.add_shape(shape, by_shape[shape])
    return {
        m: {g: {name: t[m] for name, t in by_shape[s].items()} for g, s in shapes.items()}
        for m in batch_sizes
    }


def fp16_linear_time(cfg: dict, batch: int, dtype: torch.dtype) -> float:
    """Σ over the model's linear layers of the cuBLAS time (per block × blocks)."""
    layers = [l for l in architecture.linear_layers(cfg) if l.block == 0]
    blocks = architecture.dims(cfg)["blocks"]
    per_shape = {}
    for l in layers:
        s = (l.out_features, l.in_features)
        if s not in per_shape:
            per_shape[s] = kernel_timing.time_fp16(s[0], s[1], [batch], dtype)[batch]
    return blocks * sum(per_shape[(l.out_features, l.in_features)] for l in layers)


def rotation_time(cfg: dict, batch: int, dtype: torch.dtype) -> float:
    """4 online transforms a block (before qkv, o, gate/up, down) × blocks."""
    d = architecture.dims(cfg)
    sizes = [d["hidden"], d["heads"] * d["head_dim"], d["hidden"], d["intermediate"]]
    t = {n: kernel_timing.time_rotate(n, [batch], dtype)[batch] for n in set(sizes)}
    return d["blocks"] * sum(t[n] for n in sizes)


def random_model(cfg: dict, dtype: torch.dtype, device: str = "cuda"):
    """The model of `cfg` with random weights, built on `device`, with the attention a loaded model
    runs (`use_packed_attention`, as `runtime.loading` does): transformers' sdpa would put ~9 µs a
    layer of attention and rope/cache kernels into every measured step (~0.28 ms on an 8B H100 step)
    that `qpalette bench` and users' models do not spend."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qpalette.generation.attention import use_packed_attention

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    use_packed_attention(model)
    return model


def anchor_model(cfg: dict, dtype: torch.dtype, lm_head: bool, device: str = "cuda"):
    """`random_model` with every block's linear layer ANCHOR (and lm_head when asked), random codes,
    fused as `compress` fuses them: the quantized model whose step `measure_constant` times."""
    from qpalette.compression.in_memory import quantize_model
    from qpalette.config import CompressConfig

    return quantize_model(random_model(cfg, dtype, device), None, CompressConfig(scheme=ANCHOR, lm_head=lm_head),
                          device=device, random_codes=True)


def kernel_calls(model) -> list[tuple[int, int]]:
    """(out, in) of every quantized matmul one step of `model` calls (a fused group is one call)."""
    from qpalette.runtime.modules import QuantizedLinear

    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantizedLinear)]


def decode_step_time(model, batch: int, prompt_len: int = 64, steps: int = 64) -> tuple[float, str]:
    """Seconds of one decode step of `model` in `qpalette bench`'s forward loop (torch.compile,
    CUDA graphs, static cache); eager if compiling fails (said in the method)."""
    from qpalette.measure.bench import decode_loop_step_time

    attention = f"{model.config._attn_implementation} attention, prompt {prompt_len}, {steps} steps"
    try:
        return decode_loop_step_time(model, batch, prompt_len, steps, True, 0), f"compiled forward loop ({attention})"
    except Exception as e:  # noqa: BLE001 — transformers/torch versions differ in what compiles
        torch._dynamo.reset()
        return (decode_loop_step_time(model, batch, prompt_len, steps, False, 0),
                f"eager forward loop ({attention}; compile failed: {type(e).__name__}: {str(e)[:200]})")


def _release() -> None:
    """Free what the last measured model held (compiled graphs, CUDA memory) before the next."""
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def anchor_step(cfg: dict, batch: int, dtype: torch.dtype, lm_head: bool,
                kernels: dict[tuple[int, int], float]) -> tuple[float, float, str, int]:
    """(step, the isolated kernel time of its quantized matmuls, how the step ran, its decoder
    blocks that run fused) of the ANCHOR model; `kernels` (shape → seconds) keeps the kernel timings
    for the next anchor model."""
    from qpalette.runtime.modules import fused_block_count

    model = anchor_model(cfg, dtype, lm_head)
    calls, fused = kernel_calls(model), fused_block_count(model)
    step, method = decode_step_time(model, batch)
    del model
    _release()
    for shape in set(calls) - kernels.keys():
        kernels[shape] = kernel_timing.time_quantized(ANCHOR, *shape, [batch], dtype)[0][batch]
    return step, sum(kernels[s] for s in calls), method, fused


@contextmanager
def fused_blocks_off():
    """Models loaded inside run every decoder layer's own forward (QPALETTE_FUSED_BLOCKS=0)."""
    old = os.environ.get("QPALETTE_FUSED_BLOCKS")
    os.environ["QPALETTE_FUSED_BLOCKS"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["QPALETTE_FUSED_BLOCKS"]
        else:
            os.environ["QPALETTE_FUSED_BLOCKS"] = old


def head_quantizable(cfg: dict) -> bool:
    d = architecture.dims(cfg)
    try:
        get_quantizer(ANCHOR).check_shape(d["vocab"], d["hidden"])
    except UnsupportedShape:
        return False
    return True


def anchor_parts(cfg: dict, batch: int, dtype: torch.dtype, say=_say) -> dict:
    """The anchor models' steps and their matmuls: with a 16-bit lm_head, and with a quantized one
    where ANCHOR can code its shape."""
    kernels: dict[tuple[int, int], float] = {}
    step, linear, method, fused = anchor_step(cfg, batch, dtype, False, kernels)
    parts = {"anchor": ANCHOR, "anchor_step_s": step, "anchor_linear_s": linear, "anchor_step_method": method}
    parts |= fusion_saving(cfg, batch, dtype, step, fused, kernels)
    unfused_blocks = parts["fused_block_saving_s"] * fused  # the constant holds the blocks' work unfused
    if head_quantizable(cfg):
        step, linear, method, _ = anchor_step(cfg, batch, dtype, True, kernels)
        parts |= {"anchor_head_step_s": step, "anchor_head_linear_s": linear, "anchor_head_step_method": method,
                  "constant_quantized_head_s": max(step - linear, 0.0) + unfused_blocks}
    else:
        say(f"  lm_head's shape cannot take {ANCHOR}: the quantized-head constant is derived, not measured")
    return parts


def fusion_saving(cfg: dict, batch: int, dtype: torch.dtype, step: float, fused: int,
                  kernels: dict[tuple[int, int], float]) -> dict:
    """What one fused decoder block saves: the ANCHOR model's step with every layer's own forward
    (`fused_blocks_off`) less its `step` with `fused` blocks fused, a block; 0 when none fuses or
    the runtime keeps the blocks' own forwards at this batch and these sizes (its rule, through the
    planner's `takes_block_fusion`: at batch 1 the GEMVs do the blocks' elementwise work, at batch
    2–8 the rotation kernels, above that nothing)."""
    d = architecture.dims(cfg)
    takes = all(takes_block_fusion(g, ANCHOR, n, batch) for g, n in (("qkv", d["hidden"]), ("gateup", d["hidden"]),
                                                                       ("down", d["intermediate"])))
    if not fused or not takes:
        return {"fused_blocks": 0, "fused_block_saving_s": 0.0}
    with fused_blocks_off():
        unfused, _, _, _ = anchor_step(cfg, batch, dtype, False, kernels)
    return {"fused_blocks": fused, "anchor_unfused_step_s": unfused,
            "fused_block_saving_s": max(unfused - step, 0.0) / fused}


def _require_kernels() -> None:
    if not torch.cuda.is_available():
        raise KernelError("qpalette profile measures CUDA kernels: no CUDA device is available")
    from qpalette.runtime import kernel_build

    if not kernel_build.available():  # a failed build raises its own KernelError, with the fix
        raise KernelError("qpalette profile measures the CUDA kernels, which QPALETTE_KERNELS=0 turns off")


def measure_constant(cfg: dict, batch: int, dtype: torch.dtype, say=_say) -> tuple[float, dict]:
    """(constant_s, its parts). constant_s: the step of the model with every block's layer ANCHOR
    and a 16-bit lm_head, minus the isolated times of its quantized matmuls; the same with lm_head
    quantized too gives `constant_quantized_head_s`. So the constant holds what the runtime does
    around its matmuls (rotations fused or not, attention, norms, the 16-bit head) and the gaps
    between kernels inside a model, which isolated kernel times miss. Mixture-of-experts models
    (whose experts run as grouped launches of the routed slots, and which speed plans refuse) keep
    the FP16 step less its linear layers plus the isolated rotations. The FP16 step and the isolated
    FP16, rotation and head times are kept as parts (reports, older profiles)."""
    d = architecture.dims(cfg)
    parts = {"fp16_linear_s": fp16_linear_time(cfg, batch, dtype), "rotation_s": rotation_time(cfg, batch, dtype),
             "lm_head_s": kernel_timing.time_fp16(d["vocab"], d["hidden"], [batch], dtype)[batch],
             "lm_head_rotation_s": kernel_timing.time_rotate(d["hidden"], [batch], dtype)[batch]}
    moe = any(is_expert_layer(l.name) for l in architecture.linear_layers(cfg))
    try:
        model = random_model(cfg, dtype)
        parts["fp16_step_s"], parts["step_method"] = decode_step_time(model, batch)
        del model
        _release()
        if not moe:
            parts |= anchor_parts(cfg, batch, dtype, say)
    except Exception as e:  # noqa: BLE001 — reported with the way out
        raise KernelError(f"measuring a decode step failed ({type(e).__name__}: {e}); "
                          "rerun with constant=False to keep only kernel timings") from e
    const = (max(parts["anchor_step_s"] - parts["anchor_linear_s"], 0.0)
             + parts["fused_block_saving_s"] * parts["fused_blocks"] if not moe
             else max(parts["fp16_step_s"] - parts["fp16_linear_s"], 0.0) + parts["rotation_s"])
    say(f"  batch {batch}: constant {const * 1e3:.3f} ms ("
        + (f"{ANCHOR} model step {parts['anchor_step_s'] * 1e3:.3f} ms, its matmuls "
           f"{parts['anchor_linear_s'] * 1e3:.3f} ms" if not moe else "mixture of experts: FP16 step based")
        + f"); FP16 step {parts['fp16_step_s'] * 1e3:.3f} ms ({parts['step_method']})")
    return const, parts


def profile_document(label: str, batch: int, constant: tuple[float, dict], shapes: dict, groups: dict,
                     measured: dict) -> dict:
    return {
        "format": LATENCY_FORMAT,
        "model": label,
        "device": torch.cuda.get_device_name(),
        "batch_size": batch,
        "constant_s": constant[0],
        "fused_block_saving_s": constant[1].get("fused_block_saving_s", 0.0),
        "shapes": {g: list(s) for g, s in shapes.items()},
        "groups": groups,
        "units": "seconds per decode step; groups: one block's kernel call; total = Σ blocks + constant_s",
        "source": "qpalette profile (qpalette CUDA kernels)",
        "constant": constant[1],
        "measured": measured,
    }


@dataclass
class PartialProfile:
    """What an unfinished profile has measured (`OUT_DIR/latency_<model>_b<sizes>.partial.json`,
    `qpalette.latency-partial/1`), saved atomically after each constant and each shape; `--resume`
    keeps it when its header (shapes, entries, batch sizes, dtype, GPU, torch) matches."""

    path: Path
    header: dict
    constants: dict[str, list] = field(default_factory=dict)  # batch → [constant_s, its parts]
    shapes: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # "RxC" → entry → batch → s
    seconds: float = 0.0  # spent by earlier sessions
    started: float = field(default_factory=time.time)

    @classmethod
    def open(cls, path: Path, header: dict, resume: bool, say) -> PartialProfile:
        if not path.exists():
            if resume:
                say(f"--resume: no unfinished profile at {path}; starting a new one")
            return cls(path, header)
        if not resume:
            raise InputError(f"an unfinished profile exists ({path}); pass --resume to continue it, or delete it")
        doc = read_json_object(path, "profile progress", InputError, PARTIAL_FORMAT)
        if doc.get("header") != header:
            raise InputError(f"--resume: {path} was measured with other settings (model shapes, entries, batch "
                             "sizes, dtype, GPU or torch version differ); use the same ones, or delete it")
        say(f"resuming: {len(doc['constants'])} constants and {len(doc['shapes'])} shapes already measured")
        return cls(path, header, doc["constants"], doc["shapes"], float(doc["seconds"]))

    def elapsed(self) -> float:
        return self.seconds + time.time() - self.started

    def save(self) -> None:
        atomic_write(self.path, json.dumps({"format": PARTIAL_FORMAT, "header": self.header,
                                            "constants": self.constants, "shapes": self.shapes,
                                            "seconds": self.elapsed()}, indent=1) + "\n")

    def constant(self, batch: int, measure) -> tuple[float, dict]:
        """The constant of `batch`: measured before, or now (then saved)."""
        if str(batch) not in self.constants:
            self.constants[str(batch)] = list(measure())
            self.save()
        const, parts = self.constants[str(batch)]
        return const, parts

    def has_shape(self, shape: tuple[int, int]) -> bool:
        return _key(shape) in self.shapes

    def shape(self, shape: tuple[int, int]) -> dict[str, dict[int, float]]:
        return {e: {int(m): t for m, t in by_m.items()} for e, by_m in self.shapes[_key(shape)].items()}

    def add_shape(self, shape: tuple[int, int], timings: dict[str, dict[int, float]]) -> None:
        self.shapes[_key(shape)] = {e: {str(m): t for m, t in by_m.items()} for e, by_m in timings.items()}
        self.save()


def _key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def run_profile(model: str, batch_sizes: list[int] | None = None, out_dir: str | Path = ".",
                entries: list[str] | None = None, dtype: str = "float16", constant: bool = True,
                name: str | None = None, resume: bool = False, say=_say) -> list[Path]:
    """Measure and write one `qpalette.latency/1` file per batch size; returns their paths.

    Each output file is locked (`output_lock`, FILE.lock beside it) before the minutes of
    measuring: a second profile writing one of the same files stops at once, while profiles of
    other models or batch sizes may share the folder. What is measured is saved as it comes
    (`PartialProfile`): `resume` continues a killed run; the progress file goes once every output
    is written."""
    _require_kernels()
    batch_sizes = batch_sizes or [1]
    entries = entries or list(PALETTE)
    tdtype = getattr(torch, dtype)
    cfg, _source = load_model_config(model)
    shapes = group_shapes(cfg)
    label = name or cfg.get("_name_or_path") or Path(str(model)).name  # a model id, not a local path
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(label)).name.lower())
    paths = {m: Path(out_dir) / f"latency_{stem}_b{m}.json" for m in batch_sizes}
    header = {"model": str(label), "shapes": {g: list(s) for g, s in shapes.items()}, "entries": entries,
              "batch_sizes": batch_sizes, "dtype": dtype, "constant": constant, "constant_anchor": ANCHOR,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    with ExitStack() as locks:
        for path in sorted(set(paths.values())):  # one order: two runs cannot each hold a part
            locks.enter_context(output_lock(path, "qpalette profile"))
        sizes = "-".join(str(m) for m in batch_sizes)
        run = PartialProfile.open(Path(out_dir) / f"latency_{stem}_b{sizes}.partial.json", header, resume, say)
        say(f"profiling {label}: {len(shapes)} groups, {len(set(shapes.values()))} shapes, "
            f"{len(entries)} entries, batch sizes {batch_sizes} on {torch.cuda.get_device_name()}")
        # the constants first: they fail fast where the kernel timings would take minutes
        consts = {m: run.constant(m, lambda m=m: measure_constant(cfg, m, tdtype, say) if constant else (0.0, {}))
                  for m in batch_sizes}
        groups = measure_groups(shapes, entries, batch_sizes, tdtype, say, run)
        measured = {"dtype": dtype, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "seconds": run.elapsed(), "method": "median of CUDA-graph replays, weights cycled past L2"}
        for m in batch_sizes:
            doc = profile_document(str(label), m, consts[m], shapes, groups[m], measured)
            atomic_write(paths[m], json.dumps(doc, indent=1) + "\n")
        run.path.unlink()  # killed before this: --resume writes the outputs again from the saved timings
    return [paths[m] for m in batch_sizes]
