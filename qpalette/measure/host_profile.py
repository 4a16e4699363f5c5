"""Where transformers' `generate` spends host time per decode step (issue 15).

    python scripts/profile_generate.py MODEL_DIR [MODEL_DIR ...] --out DIR [--batch 1]
        [--prompt-len 16] [--gen-len 32] [--compile-modes default,lean] [--repeats 5]

`qpalette bench` finds generate at ~3.2 ms a step whatever the GPU's work: host-bound. This says
where that host time goes. Each model is loaded as bench loads it and generate is compiled and
warmed up by bench's own `decode_step_times` (static cache, compiled on CUDA with
`hf_compile.compile_config(mode)`, greedy, never stopping early); the same call is then made
again, instrumented three ways, each looked at over its decode steps only (from the end of the
step after prefill to the end of the last step; stopping-criteria calls end the steps):
1. timers around a step's parts: the forward generate picked (the compiled callable of
   `get_compiled_call`, or eager `__call__`, counted apart: did decode use the compiled one?),
   logits processors, stopping criteria, the stop check (where generate waits for the GPU every
   step), `prepare_inputs_for_generation`, `_update_model_kwargs_for_generation`; "other" is the
   rest of the step (generate's own bookkeeping); `--repeats` calls, the median one reported;
2. cProfile: DIR/<name>_<mode>_cprofile.txt (top 60 by tottime and by cumtime) and .json;
3. torch.profiler: DIR/<name>_<mode>_torchprof.txt (ops by self and by total CPU time), kernels
   and launch calls per step.
Then bench's forward loop (`decode_loop_times`): GPU time per step and host time per call of the
compiled forward alone. DIR/summary.json and DIR/summary.md hold one record per model × mode.
On CPU nothing compiles (as in bench): the mode is "eager".
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import gc
import io
import json
import pstats
import re
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable

import torch

from qpalette.generation.hf_compile import MODES, mode_stop_check
from qpalette.measure.bench import decode_loop_times, decode_step_times

PARTS = ("compiled_call", "eager_forward", "processors", "criteria", "stop_check", "prepare_inputs",
         "update_kwargs")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# what a compiled call is made of, as torch.profiler names it (prefixes): dynamo's guards, the
# compiled region, inductor's graph call (CUDA-graph tree bookkeeping inside), the replay itself
COMPILED_PARTS = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "Pregraph bytecode",
                  "AOTDispatcher Runtime Wrapper Prologue", "## Call CompiledFxGraph", "cudaGraphLaunch")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Recorder:
    """(part, start, end) of every instrumented call. Stopping-criteria calls end each step, so their
    ends tell decode steps from prefill and setup; `on_first_step` runs once the first step ends
    (it starts a profiler, so that only decode steps are profiled)."""

    def __init__(self, on_first_step: Callable[[], object] | None = None):
        self.calls, self.step_ends, self.on_first_step = [], [], on_first_step

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.calls.append((part, t0, t1))
                if part == "criteria":
                    self.step_ends.append(t1)
                    if len(self.step_ends) == 1 and self.on_first_step:
                        self.on_first_step()
        return timed

    @property
    def steps(self) -> int:
        return len(self.step_ends) - 1

    def breakdown(self) -> dict:
        """Milliseconds per decode step of each part, "other" the rest of the step: the mean (the
        parts sum to the total) and the median over steps (robust to a slow step), and calls per part."""
        ends, n = self.step_ends, self.steps
        per, calls = {p: [0.0] * n for p in PARTS}, dict.fromkeys(PARTS, 0)
        for part, t0, t1 in self.calls:
            if t0 >= ends[0] and t1 <= ends[-1]:
                per[part][bisect.bisect_left(ends, t1) - 1] += (t1 - t0) * 1e3
                calls[part] += 1
        total = [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]
        per["other"] = [t - sum(per[p][i] for p in PARTS) for i, t in enumerate(total)]
        per = {"total": total, **per}
        return {"steps": n, "step_ms": {k: sum(v) / n for k, v in per.items()},
                "step_median_ms": {k: statistics.median(v) for k, v in per.items()}, "calls": calls,
                "used_compiled_call": calls["compiled_call"] == n and calls["eager_forward"] == 0}


@contextmanager
def _patched(owner, name: str, value):
    """owner.name = value for the block, then as it was (an instance attribute it lacked is removed)."""
    had, old = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


@contextmanager
def _instrumented(model, rec: _Recorder):
    """Timers on the parts of generate's decode step. Methods generate looks up on the model are
    replaced on the instance; the lists of processors and criteria, and the stop check, which
    generate builds itself, on their classes."""
    from transformers.generation import logits_process, stopping_criteria
    from transformers.generation import utils as gen_utils

    eager, real_compiled = model.__call__, model.get_compiled_call

    def get_compiled_call(config):
        del model.__call__  # should this compile, it must compile the model's call, not the timer
        try:
            return rec.wrap("compiled_call", real_compiled(config))
        finally:
            model.__call__ = rec.wrap("eager_forward", eager)

    targets = [(model, "__call__", "eager_forward", eager),
               (model, "prepare_inputs_for_generation", "prepare_inputs", model.prepare_inputs_for_generation),
               (model, "_update_model_kwargs_for_generation", "update_kwargs",
                model._update_model_kwargs_for_generation),
               (logits_process.LogitsProcessorList, "__call__", "processors",
                logits_process.LogitsProcessorList.__call__),
               (stopping_criteria.StoppingCriteriaList, "__call__", "criteria",
                stopping_criteria.StoppingCriteriaList.__call__)]
    if hasattr(gen_utils, "StopCheck"):  # transformers ≥ 5.1x: the per-step `bool(...)` that syncs
        targets.append((gen_utils.StopCheck, "__call__", "stop_check", gen_utils.StopCheck.__call__))
    with ExitStack() as stack:
        for owner, name, part, fn in targets:
            stack.enter_context(_patched(owner, name, rec.wrap(part, fn)))
        stack.enter_context(_patched(model, "get_compiled_call", get_compiled_call))
        yield


def _warm_up(model, batch: int, prompt_len: int, gen_len: int, compiled: bool, seed: int, mode: str):
    """bench.decode_step_times (compiles, warms up, times one call), keeping the arguments it gave
    generate, less its step clock, so that the profiled calls are the very same call."""
    seen, real = [], model.generate

    def generate(*args, **kwargs):
        seen.append((args, {k: v for k, v in kwargs.items() if k != "stopping_criteria"}))
        return real(*args, **kwargs)

    with _patched(model, "generate", generate):
        steps = decode_step_times(model, batch, prompt_len, gen_len, compiled, seed, mode)
    return statistics.median(steps), seen[-1]


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def _generate(model, call, rec: _Recorder) -> float:
    """One instrumented generate call; its wall seconds."""
    args, kwargs = call
    with _instrumented(model, rec), torch.no_grad():
        t0 = time.perf_counter()
        model.generate(*args, **kwargs)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return time.perf_counter() - t0


def _short(key: tuple) -> str:
    """pstats' (file, line, function) as one short name: the path from site-packages or the repo on."""
    file, line, func = key
    if file == "~":
        return func
    file = re.sub(r".*/(site-packages|dist-packages|qpalette)/", lambda m: "" if m[1] != "qpalette" else "qpalette/",
                  file)
    return f"{file}:{line}({func})"


def _cprofile(model, call, prefix: Path) -> dict:
    """cProfile over the decode steps of one generate call: the text report and its JSON summary."""
    prof = cProfile.Profile()
    rec = _Recorder(on_first_step=prof.enable)
    try:
        _generate(model, call, rec)
    finally:
        prof.disable()
    buf = io.StringIO()
    buf.write(f"# cProfile of {rec.steps} decode steps of one generate call (ms per step = tottime / steps)\n")
    stats = pstats.Stats(prof, stream=buf)
    for order in ("tottime", "cumulative"):
        buf.write(f"\n## top 60 by {order}\n")
        stats.sort_stats(order).print_stats(60)
    prefix.with_name(prefix.name + "_cprofile.txt").write_text(buf.getvalue())
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:60]
    top = [{"function": _short(k), "calls_per_step": nc / rec.steps, "tottime_ms_per_step": tt * 1e3 / rec.steps,
            "cumtime_ms_per_step": ct * 1e3 / rec.steps} for k, (_, nc, tt, ct, _) in rows]
    summary = {"steps": rec.steps, "top_tottime": top}
    prefix.with_name(prefix.name + "_cprofile.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _torch_profile(model, call, prefix: Path) -> dict:
    """torch.profiler over the decode steps of one generate call: ops by CPU time, kernels, launches."""
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                   record_shapes=False)
    rec = _Recorder(on_first_step=prof.start)
    try:
        _generate(model, call, rec)
    finally:
        prof.stop()
    avg, n = prof.key_averages(), rec.steps
    prefix.with_name(prefix.name + "_torchprof.txt").write_text(
        f"# torch.profiler over {n} decode steps of one generate call\n\n## by self CPU time\n"
        + avg.table(sort_by="self_cpu_time_total", row_limit=50)
        + "\n\n## by total CPU time (inclusive)\n" + avg.table(sort_by="cpu_time_total", row_limit=50) + "\n")
    rows = sorted((e for e in avg if e.device_type != torch.autograd.DeviceType.CUDA),
                  key=lambda e: -e.self_cpu_time_total)
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    by_name = {e.key: e for e in avg}
    return {
        "steps": n,
        "top_self_cpu": [{"op": e.key, "calls_per_step": e.count / n, "self_cpu_ms_per_step": e.self_cpu_time_total
                          / 1e3 / n, "cpu_ms_per_step": e.cpu_time_total / 1e3 / n} for e in rows[:25]],
        "gpu_kernels_per_step": kernels / n,
        "launch_calls_per_step": {k: by_name[k].count / n for k in LAUNCH_CALLS if k in by_name},
        "sync_ms_per_step": sum(by_name[k].self_cpu_time_total for k in SYNC_CALLS if k in by_name) / 1e3 / n,
        "compiled_call_parts_ms_per_step": {  # inclusive CPU time, so the parts nest
            m: sum(e.cpu_time_total for e in avg if e.key.startswith(m)) / 1e3 / n for m in COMPILED_PARTS},
    }


def _timed_calls(model, call, repeats: int) -> dict:
    """The timed breakdown of `repeats` calls: the call of median mean step time, with every call's
    mean step time beside it (the host's speed drifts from call to call)."""
    runs = []
    for _ in range(repeats):
        rec = _Recorder()
        call_s = _generate(model, call, rec)
        runs.append({**rec.breakdown(), "generate_call_ms": call_s * 1e3})
    runs.sort(key=lambda r: r["step_ms"]["total"])
    return {**runs[len(runs) // 2], "repeat_step_ms": [r["step_ms"]["total"] for r in runs]}


def profile_mode(model, name: str, mode: str, compiled: bool, batch: int, prompt_len: int, gen_len: int,
                 out: Path, seed: int = 0, repeats: int = 5) -> dict:
    """One record of summary.json: generate warmed up in compile mode `mode`, then timed,
    cProfiled and torch-profiled over its decode steps; bench's forward loop beside it."""
    label = mode if compiled else "eager"
    prefix = out / f"{name}_{label}"
    _log(f"{name} [{label}]: compiling and warming up generate")
    step_s, call = _warm_up(model, batch, prompt_len, gen_len, compiled, seed, mode)
    frames = _frames_compiled()
    _log(f"{name} [{label}]: timing, cProfile, torch.profiler")
    with mode_stop_check(mode):  # as decode_step_times ran it
        parts = _timed_calls(model, call, repeats)
        cprof = _cprofile(model, call, prefix)
        tprof = _torch_profile(model, call, prefix)
    frames = _frames_compiled() - frames
    _log(f"{name} [{label}]: forward loop")
    loop_s, loop_host_s = decode_loop_times(model, batch, prompt_len, gen_len,
                                            ("reduce-overhead" if mode == "default" else mode) if compiled else None,
                                            seed)
    return {"name": name, "mode": label, "compiled": compiled, "batch": batch, "prompt_len": prompt_len,
            "gen_len": gen_len, "generate_ms_per_step": step_s * 1e3, **parts,
            "frames_compiled_while_profiling": frames, "loop_gpu_ms_per_step": loop_s * 1e3,
            "loop_host_ms_per_call": loop_host_s * 1e3, "top_tottime": cprof["top_tottime"][:15],
            "torch_profiler": tprof,
            "files": [str(prefix) + s for s in ("_cprofile.txt", "_cprofile.json", "_torchprof.txt")]}


def profile_model(model_dir, out: Path, batch: int = 1, prompt_len: int = 16, gen_len: int = 32,
                  modes: tuple[str, ...] = ("default",), device: str = "auto", seed: int = 0,
                  name: str | None = None, repeats: int = 5) -> list[dict]:
    """Records for one model (FP16 folder or qpalette checkpoint, loaded as `qpalette bench` does):
    one per compile mode on CUDA, one eager record on CPU."""
    from qpalette.devices import resolve_device
    from qpalette.models.sources import resolve_model
    from qpalette.runtime.loading import load_model

    dev = resolve_device(device)
    path = resolve_model(model_dir, quiet=True)
    name = name or re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).name)
    _log(f"{name}: loading {path} on {dev}")
    model, _ = load_model(path, dev, tokenizer=False)
    compiled = dev.type == "cuda"
    common = {"model": str(model_dir), "device": torch.cuda.get_device_name(dev) if compiled else "cpu",
              "dtype": str(model.dtype).removeprefix("torch."),
              "quantized": "quantization_config" in model.config.to_dict(),
              "tensors": sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers()),
              "torch": torch.__version__, "transformers": _transformers_version()}
    try:
        return [{**common, **profile_mode(model, name, m, compiled, batch, prompt_len, gen_len, out, seed,
                                               repeats)}
                for m in (modes if compiled else ("default",))]
    finally:
        del model
        gc.collect()
        if compiled:
            torch.cuda.empty_cache()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def profile_models(model_dirs, out: Path, modes: tuple[str, ...] = ("default",), **kw) -> list[dict]:
    """profile_model for each model, then DIR/summary.json and DIR/summary.md; the records."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"compile modes {','.join(modes)}: choose from {', '.join(MODES)}")
    records, names = [], set()
    for d in model_dirs:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(d).name) or "model"
        while name in names:
            name += "_"
        names.add(name)
        records += profile_model(d, out, modes=modes, name=name, **kw)
    (out / "summary.json").write_text(json.dumps({"format": "qpalette.host_profile/1", "records": records},
                                                 indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(records))
    return records


def summary_line(r: dict) -> str:
    """One record in one line: where generate's step goes, beside the forward loop."""
    s, med = r["step_ms"], r["step_median_ms"]
    parts = ", ".join(f"{k.replace('_', ' ')} {s[k]:.3f}" for k in (*PARTS, "other") if s[k] or k == "other")
    return (f"{r['name']} [{r['mode']}] generate {r['generate_ms_per_step']:.3f} ms/step (bench clock); "
            f"instrumented {s['total']:.3f} ms/step (median {med['total']:.3f}) = {parts}; forward calls compiled "
            f"{r['calls']['compiled_call']} / eager {r['calls']['eager_forward']} of {r['steps']} steps; "
            f"forward loop GPU {r['loop_gpu_ms_per_step']:.3f} ms/step, host {r['loop_host_ms_per_call']:.3f} ms/call")


def _table(records: list[dict], key: str, cols: tuple[str, ...]) -> list[str]:
    lines = ["| model | mode | generate (bench) | " + " | ".join(c.replace("_", " ") for c in cols)
             + " | loop GPU | loop host/call | kernels/step | launches/step |", "|" + "---|" * (len(cols) + 7)]
    for r in records:
        tp = r["torch_profiler"]
        lines.append(f"| {r['name']} | {r['mode']} | {r['generate_ms_per_step']:.3f} | "
                     + " | ".join(f"{r[key][c]:.3f}" for c in cols)
                     + f" | {r['loop_gpu_ms_per_step']:.3f} | {r['loop_host_ms_per_call']:.3f} | "
                     f"{tp['gpu_kernels_per_step']:.0f} | {sum(tp['launch_calls_per_step'].values()):.0f} |")
    return lines


def summary_markdown(records: list[dict]) -> str:
    """DIR/summary.md: the breakdown tables, then each record's top functions and ops."""
    cols = ("total", *PARTS, "other")
    lines = ["# Host time of transformers' generate per decode step (ms)", "",
             "Mean over the decode steps of the median of the timed calls (the parts sum to the total):", "",
             *_table(records, "step_ms", cols), "", "Median over the same steps, part by part:", "",
             *_table(records, "step_median_ms", cols)]
    for r in records:
        lines += ["", f"## {r['name']} [{r['mode']}] on {r['device']}", "", summary_line(r), "",
                  "Mean step of each timed call (ms): " + ", ".join(f"{t:.3f}" for t in r["repeat_step_ms"]), "",
                  "Compiled call per step as torch.profiler sees it (inclusive CPU ms): " + ", ".join(
                      f"{k} {v:.3f}" for k, v in r["torch_profiler"]["compiled_call_parts_ms_per_step"].items()),
                  "", "cProfile, top 15 by tottime (ms per step, calls per step):", ""]
        lines += [f"- {t['tottime_ms_per_step']:.3f} ({t['calls_per_step']:.1f}) `{t['function']}`"
                  for t in r["top_tottime"]]
        lines += ["", "torch.profiler, top 10 by self CPU time (ms per step, calls per step):", ""]
        lines += [f"- {t['self_cpu_ms_per_step']:.3f} ({t['calls_per_step']:.1f}) `{t['op']}`"
                  for t in r["torch_profiler"]["top_self_cpu"][:10]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="Hugging Face folders (FP16) or qpalette checkpoints")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--compile-modes", default="default", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="timed generate calls (the median one is reported)")
    a = ap.parse_args(argv)
    if a.gen_len < 4 or min(a.batch, a.prompt_len, a.repeats) < 1:
        ap.error("--gen-len must be ≥ 4, --batch, --prompt-len and --repeats ≥ 1")
    modes = tuple(m.strip() for m in a.compile_modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES):
        ap.error(f"--compile-modes {a.compile_modes}: choose from {', '.join(MODES)}")
    records = profile_models(a.models, a.out, modes, batch=a.batch, prompt_len=a.prompt_len, gen_len=a.gen_len,
                             device=a.device, seed=a.seed, repeats=a.repeats)
    for r in records:
        print(summary_line(r))
    _log(f"wrote {a.out / 'summary.json'}, {a.out / 'summary.md'} and per-run profiles")


if __name__ == "__main__":
    main()
