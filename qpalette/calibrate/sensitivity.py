"""Per-layer sensitivity coefficients a_l by the linearity theorem (docs/method.md §4, HIGGS protocol).

Loss(Q(W)) − Loss(W) ≈ Σ_l a_l · err_l, with err_l = ‖Q(W_l) − W_l‖²_F / ‖W_l‖²_F.

For every linear layer l inside the decoder blocks and every noise level t_i = t_max · i/levels
(i = 1..levels) the weight is perturbed in place, W_l ← W_l + t_i · ‖W_l‖_F · ε/‖ε‖_F (by
default one ε ~ N(0, I) per layer, scaled over the levels; `directions="fresh"` draws one per
level), and the mean KL divergence of the perturbed model's next-token distribution from the unperturbed one is measured over a fixed evaluation set. Since the noise has
err = t², fitting ΔKL ≈ a_l · t² by least squares through the origin gives a_l in the unit the
planner needs (nats of KL per unit of nmse).

Evaluation set: `data-free` samples sequences from the model itself at temperature 1 (starting
from BOS); `data-aware` cuts real text (a file or a `datasets` split) into windows. In both cases
the loss is the KL from the unperturbed model's predictions at every position.

Cost: the unperturbed input of the block being perturbed is cached (for all evaluation tokens), so
only the blocks from the perturbed one onward run; the reference log-probs are cached (or the
final hidden state, when they do not fit). The original weight is kept aside and copied back
after the layer's levels, so nothing drifts. Layers are spread round-robin over every device
given (one process per GPU), each process advancing the block cache itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from qpalette.errors import CalibrationError
from qpalette.fileio import atomic_write_json

FORMAT = "qpalette.sensitivity/1"
PARTIAL_FORMAT = "qpalette.sensitivity-partial/1"


# --------------------------------------------------------------------------- small pieces


def noise_levels(levels: int, t_max: float = 1.0) -> list[float]:
    """t_i = t_max · i / levels, i = 1..levels."""
    return [t_max * i / levels for i in range(1, levels + 1)]


def fit_through_origin(t: Iterable[float], y: Iterable[float]) -> tuple[float, float]:
    """Least squares y ≈ a·t² through the origin → (a, R²); R² is the usual centred one."""
    x = [ti * ti for ti in t]
    y = list(y)
    sxx = sum(xi * xi for xi in x)
    a = sum(xi * yi for xi, yi in zip(x, y)) / sxx
    mean = sum(y) / len(y)
    ss_res = sum((yi - a * xi) ** 2 for xi, yi in zip(x, y))
    ss_tot = sum((yi - mean) ** 2 for yi in y)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return a, r2


def noise_seed(seed: int, layer_index: int, level: int) -> int:
    """Seed of ε for (run seed, layer index in model order, level index 1..L)."""
    return (seed * 1_000_003 + layer_index * 10_007 + level * 101 + 12_345) % (2**62)


def noise_direction(shape, seed: int, layer_index: int, level: int, device) -> torch.Tensor:
    """ε/‖ε‖_F (float32) for one (layer, level), generated on `device`."""
    g = torch.Generator(device=device).manual_seed(noise_seed(seed, layer_index, level))
    eps = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return eps.div_(torch.linalg.vector_norm(eps))


def linear_layers(model) -> list[tuple[str, torch.nn.Linear, int]]:
    """(full name, module, block index) of every nn.Linear inside the decoder blocks, in order."""
    out = []
    for j, block in enumerate(decoder_blocks(model)):
        for name, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear):
                out.append((f"model.layers.{j}.{name}", mod, j))
    return out


def decoder_blocks(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or getattr(model, "lm_head", None) is None or getattr(base, "norm", None) is None:
        raise CalibrationError(
            f"{type(model).__name__}: expected a decoder-only LM with model.layers, model.norm and "
            "lm_head (Llama/Mistral/Qwen-style)"
        )
    return layers


# --------------------------------------------------------------------------- evaluation sets


@torch.no_grad()
def sample_tokens(model, num_seqs: int, seq_len: int, seed: int, batch: int, bos_id: int, device,
                  progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """num_seqs sequences of seq_len tokens: BOS, then samples of the model at temperature 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for b0 in range(0, num_seqs, batch):
        b = min(batch, num_seqs - b0)
        ids = torch.full((b, 1), bos_id, dtype=torch.long, device=device)
        seq = [ids]
        past = None
        for _ in range(seq_len - 1):
            o = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = o.past_key_values
            probs = torch.softmax(o.logits[:, -1].float(), dim=-1)
            ids = torch.multinomial(probs, 1, generator=g)
            seq.append(ids)
        out.append(torch.cat(seq, dim=1).cpu())
        if progress:
            progress(b)
        del past
    return torch.cat(out)


def text_tokens(tokenizer, text: str, num_seqs: int, seq_len: int) -> torch.Tensor:
    """Consecutive windows of seq_len tokens from `text` (at most num_seqs of them)."""
    if tokenizer is None:
        raise CalibrationError("the model has no tokenizer; data-aware calibration needs one")
    need = num_seqs * seq_len
    chars = need * 8  # tokenize only a prefix large enough (whole files can be slow to tokenize)
    while True:
        ids = tokenizer(text[:chars], return_tensors=None, add_special_tokens=False)["input_ids"]
        if len(ids) > need or chars >= len(text):
            break
        chars *= 2
    n = min(num_seqs, len(ids) // seq_len)
    if n < 1:
        raise CalibrationError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def load_text(text_file: str | None, dataset: str | None) -> tuple[str, str]:
    """(text, description) from a text file or a `datasets` spec NAME[:CONFIG[:SPLIT]]."""
    if text_file:
        p = Path(text_file)
        if not p.is_file():
            raise CalibrationError(f"--text-file {p}: no such file")
        return p.read_text(encoding="utf-8", errors="replace"), f"file:{p.name}"
    parts = dataset.split(":")
    if len(parts) > 3 or not parts[0]:
        raise CalibrationError("--dataset takes NAME[:CONFIG[:SPLIT]], e.g. wikitext:wikitext-2-raw-v1:test")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), (
        parts[2] if len(parts) > 2 else "test")
    try:
        import datasets
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        raise CalibrationError(f"cannot load dataset {dataset}: {type(e).__name__}: {str(e)[:200]}") from None
    col = "text" if "text" in ds.column_names else next(
        (c for c in ds.column_names if isinstance(ds[0][c], str)), None)
    if col is None:
        raise CalibrationError(f"dataset {dataset} has no text column")
    return "\n\n".join(t for t in ds[col] if t and t.strip()), f"dataset:{dataset}"


# --------------------------------------------------------------------------- the evaluator


class BlockEvaluator:
    """Mean KL(p_ref ‖ p_perturbed) over a fixed token set, running only blocks j.. onward."""

    def __init__(self, model, tokens: torch.Tensor, batch_size: int, device, cache_ref_bytes: int):
        self.model = model
        self.blocks = decoder_blocks(model)
        self.norm = model.model.norm
        self.head = model.lm_head
        self.device = torch.device(device)
        self.chunks = [tokens[i: i + batch_size] for i in range(0, tokens.shape[0], batch_size)]
        self.n_tokens = tokens.numel()
        self.kwargs = {}
        self.hidden = []  # input of block `self.block` for each chunk
        self.block = 0
        self.final = []
        self.ref_lp = None
        self._cache_ref_bytes = cache_ref_bytes

    @torch.no_grad()
    def prepare(self) -> None:
        """Embeddings + per-shape block kwargs, then one unperturbed pass for the references."""
        for chunk in self.chunks:
            h, kw = self._capture(chunk.to(self.device))
            self.hidden.append(h)
            self.kwargs.setdefault(chunk.shape[0], kw)
        self.final = [self._run_blocks(0, h, self.kwargs[h.shape[0]]) for h in self.hidden]
        vocab = self.head.out_features
        if self.n_tokens * vocab * 4 <= self._cache_ref_bytes:
            self.ref_lp = [self._logprobs(h) for h in self.final]
            self.final = None

    def _capture(self, ids):
        box = {}

        class _Stop(Exception):
            pass

        def hook(_mod, args, kwargs):
            box["h"] = args[0] if args else kwargs.pop("hidden_states")
            box["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            raise _Stop

        handle = self.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.model.model(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()
        kw = box["kw"]
        kw.pop("past_key_values", None)
        kw["use_cache"] = False
        return box["h"], kw

    def _run_blocks(self, start: int, h, kw):
        for blk in self.blocks[start:]:
            h = blk(h, **kw)
            if isinstance(h, tuple):
                h = h[0]
        return h

    def _logprobs(self, h):
        logits = self.head(self.norm(h))
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return F.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def advance_to(self, block: int) -> None:
        """Move the cached block inputs forward (unperturbed) to the input of `block`."""
        if block < self.block:
            raise ValueError("the block cache only moves forward")
        while self.block < block:
            self.hidden = [self._run_blocks_one(self.block, h) for h in self.hidden]
            self.block += 1

    def _run_blocks_one(self, j, h):
        out = self.blocks[j](h, **self.kwargs[h.shape[0]])
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def mean_kl(self) -> float:
        """Mean per-token KL of the current model (perturbed in block ≥ self.block) from the reference."""
        total = 0.0
        for i, h in enumerate(self.hidden):
            out = self._run_blocks(self.block, h, self.kwargs[h.shape[0]])
            lp = self._logprobs(out)
            ref = self.ref_lp[i] if self.ref_lp is not None else self._logprobs(self.final[i])
            total += float(F.kl_div(lp, ref, log_target=True, reduction="sum").double())
            del out, lp, ref
        return total / self.n_tokens


# --------------------------------------------------------------------------- one worker


@dataclass
class Settings:
    seed: int
    levels: int
    t_max: float
    batch_size: int
    dtype: str
    directions: str = "shared"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = "tf32" if device.type == "cuda" else "float32"
    if name == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.float32
    if name == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False
        return torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def ref_cache_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.35)
    return 1 << 30


def run_layers(model, tokens: torch.Tensor, todo: list[str], settings: Settings, device,
               report: Callable[[str, list[float], float], None],
               tick: Callable[[], None] = lambda: None) -> None:
    """Measure ΔKL at every level for the layers named in `todo`; report(name, dkl, seconds)."""
    device = torch.device(device)
    layers = linear_layers(model)
    index = {name: k for k, (name, _m, _b) in enumerate(layers)}
    wanted = set(todo)
    ev = BlockEvaluator(model, tokens, settings.batch_size, device, ref_cache_budget(device))
    ev.prepare()
    ts = noise_levels(settings.levels, settings.t_max)
    for name, mod, block in layers:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        ev.advance_to(block)
        w = mod.weight
        original = w.detach().clone()
        w0 = original.float()
        norm = float(torch.linalg.vector_norm(w0))
        dkl = []
        try:
            shared = None
            if settings.directions == "shared":
                shared = noise_direction(w.shape, settings.seed, index[name], 0, device)
            for i, t in enumerate(ts, start=1):
                eps = shared if shared is not None else noise_direction(
                    w.shape, settings.seed, index[name], i, device)
                with torch.no_grad():
                    w.copy_((w0 + eps * (t * norm)).to(w.dtype))
                del eps
                dkl.append(ev.mean_kl())
                tick()
        finally:
            with torch.no_grad():
                w.copy_(original)  # exact restore: the saved tensor, not W − noise
        del original, w0
        report(name, dkl, time.perf_counter() - t0)


def _worker(rank: int, device: str, model_dir: str, tokens_file: str, todo: list[str],
            settings: dict, queue) -> None:
    """Process entry point for one device (multi-device runs)."""
    try:
        from safetensors.torch import load_file

        from qpalette.models.sources import load_model

        torch.manual_seed(0)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        st = Settings(**settings)
        dtype = resolve_dtype(st.dtype, dev)
        model, _tok = load_model(Path(model_dir), dev, dtype)
        tokens = load_file(tokens_file)["tokens"]
        run_layers(model, tokens, todo, st, dev,
                   report=lambda n, d, s: queue.put(("layer", rank, n, d, s)),
                   tick=lambda: queue.put(("tick", rank)))
        queue.put(("done", rank))
    except BaseException as e:  # reported to the parent, which prints it
        queue.put(("error", rank, f"{type(e).__name__}: {e}"))


# --------------------------------------------------------------------------- the command


@dataclass
class CalibrateOptions:
    model: str
    output: Path
    num_seqs: int = 256
    seq_len: int = 512
    levels: int = 16
    t_max: float = 1.0
    seed: int = 0
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    batch_size: int = 0
    dtype: str = "auto"
    dataset: str | None = None
    text_file: str | None = None
    layers: str | None = None  # regex filter on layer names
    directions: str = "shared"  # one noise direction per layer scaled over levels, or fresh per level
    resume: bool = False
    progress: bool = True


def parse_devices(spec: str) -> list[str]:
    """auto | cpu | cuda (all visible GPUs) | cuda:0,cuda:1 | cpu,cpu (several CPU workers)."""
    spec = spec.strip().lower()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return [f"cuda:{i}" for i in range(n_gpu)] or ["cpu"]
    if spec == "cuda":
        if not n_gpu:
            raise CalibrationError("--device cuda asked for, but no CUDA GPU is visible")
        return [f"cuda:{i}" for i in range(n_gpu)]
    out = []
    for part in spec.split(","):
        part = part.strip()
        if part == "cpu":
            out.append("cpu")
            continue
        m = re.fullmatch(r"cuda:(\d+)", part)
        if not m:
            raise CalibrationError(f"bad --device '{part}': use auto, cpu, cuda or cuda:N[,cuda:M...]")
        if int(m.group(1)) >= n_gpu:
            raise CalibrationError(f"--device {part}: only {n_gpu} CUDA GPU(s) visible")
        out.append(part)
    return out


def _auto_batch(seq_len: int, vocab: int, device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        tokens = int(free * 0.12 / (vocab * 4 * 4))
        tokens = min(tokens, 32768)
    else:
        tokens = 2048
    return max(1, tokens // seq_len)


def _header(opts: CalibrateOptions, protocol: str, source: str, n_seqs: int) -> dict:
    return {
        "model": opts.model,
        "protocol": protocol,
        "source": source,
        "tokens": n_seqs * opts.seq_len,
        "num_seqs": n_seqs,
        "seq_len": opts.seq_len,
        "levels": opts.levels,
        "t_max": opts.t_max,
        "seed": opts.seed,
        "layer_filter": opts.layers,
        "loss": "mean next-token KL(original || perturbed), nats per token",
        "directions": opts.directions,
        "noise": "W <- W + t*||W||_F*eps/||eps||_F, eps ~ N(0,I) "
                 + ("one per layer, scaled over the levels" if opts.directions == "shared"
                    else "fresh per (layer, level)") + "; err = t^2",
    }


_RESUME_KEYS = ("model", "protocol", "source", "seq_len", "levels", "t_max", "seed", "layer_filter",
                "directions")


def _partial_paths(output: Path) -> tuple[Path, Path]:
    return (output.with_name(output.name + ".partial.json"),
            output.with_name(output.name + ".tokens.safetensors"))


def calibrate(opts: CalibrateOptions, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) a calibration and write opts.output. Returns the written document."""
    from safetensors.torch import load_file, save_file

    from qpalette.models.sources import load_model, resolve_model

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
    if opts.dtype not in ("auto", "float32", "tf32", "bfloat16", "float16"):
        raise CalibrationError("--dtype: auto, float32, tf32, bfloat16 or float16")
    if opts.layers:
        try:
            re.compile(opts.layers)
        except re.error as e:
            raise CalibrationError(f"--layers is not a valid regular expression: {e}") from None
    devices = opts.devices
    t_start = time.perf_counter()
    model_dir = resolve_model(opts.model)
    main_dev = torch.device(devices[0])
    settings = Settings(seed=opts.seed, levels=opts.levels, t_max=opts.t_max,
                        batch_size=opts.batch_size, dtype=opts.dtype, directions=opts.directions)
    dtype = resolve_dtype(opts.dtype, main_dev)
    model, tok = load_model(model_dir, main_dev, dtype)
    all_layers = linear_layers(model)
    names = [n for n, _m, _b in all_layers]
    if opts.layers:
        names = [n for n in names if re.search(opts.layers, n)]
        if not names:
            raise CalibrationError(f"--layers '{opts.layers}' matches no linear layer")
    shapes = {n: list(m.weight.shape) for n, m, _b in all_layers}
    protocol = "data-aware" if (opts.dataset or opts.text_file) else "data-free"

    output = Path(opts.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial_path, tokens_path = _partial_paths(output)
    done: dict[str, dict] = {}
    timing_prev = {}
    tokens = None
    if partial_path.exists() and not opts.resume:
        raise CalibrationError(
            f"an unfinished run exists ({partial_path}); pass --resume to continue it or delete it")
    if opts.resume and partial_path.exists():
        try:
            partial = json.loads(partial_path.read_text())
            tokens = load_file(str(tokens_path))["tokens"]
        except Exception as e:
            raise CalibrationError(f"cannot read the resume files {partial_path}, {tokens_path}: {e}") from None
        if partial.get("format") != PARTIAL_FORMAT:
            raise CalibrationError(f"{partial_path} is not a qpalette resume file")
        want = _header(opts, protocol, partial["header"].get("source", ""), tokens.shape[0])
        diff = [k for k in _RESUME_KEYS if partial["header"].get(k) != want.get(k)]
        if diff:
            raise CalibrationError(
                "--resume: the unfinished run used other settings ("
                + ", ".join(f"{k}={partial['header'].get(k)!r} vs {want.get(k)!r}" for k in diff)
                + "); use the same options or delete " + str(partial_path))
        done = partial["layers"]
        timing_prev = partial.get("timing", {})
        header = partial["header"]
        log(f"resuming: {len(done)}/{len(names)} layers already measured")
    elif opts.resume:
        log(f"--resume: no unfinished run next to {output}; starting a new one")

    t_data = time.perf_counter()
    if tokens is None:
        if protocol == "data-aware":
            text, source = load_text(opts.text_file, opts.dataset)
            tokens = text_tokens(tok, text, opts.num_seqs, opts.seq_len)
            if tokens.shape[0] < opts.num_seqs:
                log(f"note: the text gives only {tokens.shape[0]} windows of {opts.seq_len} tokens")
        else:
            source = "model samples, temperature 1"
            bos = (tok.bos_token_id if tok is not None else None)
            if bos is None:
                bos = model.config.bos_token_id if model.config.bos_token_id is not None else 0
            if isinstance(bos, list):
                bos = bos[0]
            sample_batch = opts.num_seqs if main_dev.type == "cuda" else min(opts.num_seqs, 16)
            bar = _bar(opts.num_seqs, "sampling", "seq", opts.progress)
            tokens = sample_tokens(model, opts.num_seqs, opts.seq_len, opts.seed, min(sample_batch, 256),
                                   int(bos), main_dev, progress=bar.update)
            bar.close()
        header = _header(opts, protocol, source, tokens.shape[0])
        save_file({"tokens": tokens.contiguous()}, str(tokens_path) + ".tmp",
                  metadata={"header": json.dumps(header)})
        os.replace(str(tokens_path) + ".tmp", tokens_path)
        atomic_write_json(partial_path, {"format": PARTIAL_FORMAT, "header": header, "layers": {}})
    sampling_s = time.perf_counter() - t_data

    todo = [n for n in names if n not in done]
    if main_dev.type == "cuda":
        torch.cuda.empty_cache()  # sampling's KV caches would hide free memory from _auto_batch
    batch = opts.batch_size or _auto_batch(opts.seq_len, model.lm_head.out_features, devices[0])
    settings.batch_size = batch
    timing = {
        "devices": devices,
        "dtype": str(dtype).replace("torch.", "") + ("/tf32" if opts.dtype in ("tf32", "auto") and main_dev.type == "cuda" else ""),
        "batch_size": batch,
        "sampling_s": round(timing_prev.get("sampling_s", 0.0) + sampling_s, 3),
    }

    def save_partial():
        atomic_write_json(partial_path, {"format": PARTIAL_FORMAT, "header": header, "layers": done,
                                         "timing": timing})

    ts = noise_levels(opts.levels, opts.t_max)

    def record(name, dkl, seconds):
        a, r2 = fit_through_origin(ts, dkl)
        done[name] = {"a": a, "r2": r2, "shape": shapes[name], "delta_kl": dkl, "seconds": round(seconds, 3)}
        save_partial()

    bar = _bar(len(todo) * opts.levels, "calibrate", "eval", opts.progress)
    t_layers = time.perf_counter()
    try:
        if not todo:
            pass
        elif len(devices) == 1:
            run_layers(model, tokens, todo, settings, main_dev, report=record, tick=lambda: bar.update(1))
        else:
            del model
            _run_multi(devices, model_dir, tokens_path, todo, settings, record, bar)
    except KeyboardInterrupt:
        bar.close()
        raise CalibrationError(
            f"interrupted: {len(done)}/{len(names)} layers saved in {partial_path}; "
            f"rerun with --resume to continue") from None
    finally:
        bar.close()
    layers_s = time.perf_counter() - t_layers

    per_layer = [done[n]["seconds"] for n in names]
    timing.update({
        "layers_s": round(timing_prev.get("layers_s", 0.0) + layers_s, 3),
        "total_s": round(timing_prev.get("total_s", 0.0) + time.perf_counter() - t_start, 3),
        "mean_layer_s": round(sum(per_layer) / len(per_layer), 4),
        "evaluations": len(names) * opts.levels,
    })
    timing["resumed"] = bool(timing_prev)
    r2s = sorted(done[n]["r2"] for n in names)
    doc = {"format": FORMAT, **header, "n_layers": len(names),
           "median_r2": r2s[len(r2s) // 2] if len(r2s) % 2 else 0.5 * (r2s[len(r2s) // 2 - 1] + r2s[len(r2s) // 2]),
           "layers": {n: done[n] for n in names}, "timing": timing}
    atomic_write_json(output, doc)
    for p in (partial_path, tokens_path):
        p.unlink(missing_ok=True)
    return doc


def _run_multi(devices, model_dir, tokens_path, todo, settings, record, bar):
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shards = [todo[r::len(devices)] for r in range(len(devices))]
    procs = []
    for rank, dev in enumerate(devices):
        if not shards[rank]:
            continue
        p = ctx.Process(target=_worker, args=(rank, dev, str(model_dir), str(tokens_path), shards[rank],
                                               asdict(settings), q), daemon=True)
        p.start()
        procs.append(p)
    running = len(procs)
    try:
        while running:
            try:
                msg = q.get(timeout=5)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    raise CalibrationError("a calibration worker died without reporting (out of memory?)")
                continue
            kind = msg[0]
            if kind == "tick":
                bar.update(1)
            elif kind == "layer":
                record(msg[2], msg[3], msg[4])
            elif kind == "done":
                running -= 1
            elif kind == "error":
                raise CalibrationError(f"worker on {devices[msg[1]]} failed: {msg[2]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)


def _bar(total: int, desc: str, unit: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True, smoothing=0.05)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else 0.0
