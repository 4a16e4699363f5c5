"""The README's main job on the embedded default model (SmolLM2-135M-Instruct).

Runs, as a user would: the palette table → data-free calibration → a mixed-scheme plan →
compress → load the checkpoint in transformers → generate, then prints WikiText-2 perplexity
and generation speed of the compressed model next to the original. Outputs go to
./qpalette-demo/ (or --out).

On a CPU-only machine the demo keeps to minutes: calibration uses 4×64 tokens and 4 noise
levels, and the plan's palette is NUQ + VQ only (trellis quantization of a whole model takes
hours on a few CPU cores); with a GPU it calibrates on the default 128K tokens and plans over
the whole palette (TCQ and half-TCQ included).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch


def run(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "qpalette.cli", *args]
    print(f"\n$ qpalette {shlex.join(args)}", flush=True)
    t0 = time.time()
    if subprocess.run(cmd).returncode:
        sys.exit(f"demo stopped: `qpalette {shlex.join(args)}` failed")
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


def generate(model_dir: Path, prompt: str, device: str, new_tokens: int) -> tuple[str, float]:
    """Greedy continuation of a chat prompt by qpalette's decoder (what `qpalette generate` runs) and
    its decode tokens/s (the second of two calls: the first captures the CUDA graphs on a GPU)."""
    import qpalette
    from qpalette.runtime.loading import load_model

    model, tok = load_model(model_dir, device)
    for _ in range(2):
        out = qpalette.generate(model, tok, prompt, chat=True, max_new_tokens=new_tokens, stop_at_eos=False)
    return out.texts[0].strip(), out.result.decode_tok_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("qpalette-demo"))
    ap.add_argument("--budget", default="3.25bits")
    ap.add_argument("--text-file", type=Path, default=None,
                    help="Perplexity text (default: WikiText-2 test from ../shared/data or $QPALETTE_SHARED).")
    ap.add_argument("--windows", type=int, default=None,
                    help="Perplexity windows of 2048 tokens (default: all on GPU, 6 on CPU).")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    sens, plan, qdir = args.out / "sens.json", args.out / "plan.json", args.out / "compressed"
    t_start = time.time()

    from qpalette.models.sources import resolve_model

    src = resolve_model(args.model)
    run(["palette", "--family", "tcq", "--family", "nuq", "--family", "vq"])
    # CPU: 4 sequences × 64 tokens and 4 noise levels keep the 210 layers to minutes on 2 cores
    # (median R² stays > 0.99 at this size; the GPU runs the default 128K tokens × 2 levels)
    size = [] if gpu else ["--num-seqs", "4", "--seq-len", "64", "--levels", "4"]
    run(["calibrate", str(src), "-o", str(sens), *size])
    palette = "tcq,half-tcq,vq,nuq" if gpu else "vq,nuq"
    run(["plan", str(src), "--budget", args.budget, "-s", str(sens), "-o", str(plan),
         "--palette", palette, "--no-plot"])
    run(["compress", str(src), "--plan", str(plan), "-o", str(qdir), "--overwrite"])

    text = args.text_file or _shared_wikitext()
    windows = args.windows or (None if gpu else 6)
    ppl = {}
    if text is None:
        print("\n(no WikiText-2 file found: set QPALETTE_SHARED or pass --text-file; skipping perplexity)")
    else:
        for name, d in (("original", src), ("compressed", qdir)):
            res = args.out / f"ppl_{name}.json"
            extra = ["--max-windows", str(windows)] if windows else []
            run(["eval", str(d), "--text-file", str(text), "--ctx", "2048", "--device", device,
                 "--json", str(res), *extra])
            ppl[name] = json.loads(res.read_text())

    prompt = "Write one sentence about the ocean."
    print(f"\nprompt: {prompt}")
    speed = {}
    for name, d in (("original", src), ("compressed", qdir)):
        reply, speed[name] = generate(Path(d), prompt, device, 24)
        print(f"  {name:>10}: {reply!r}  ({speed[name]:.1f} tok/s)")

    p = json.loads(plan.read_text())
    by = p["totals"]["bytes"]
    orig_bytes = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
    print("\n== summary ==")
    print(f"model {args.model}, plan {args.budget} over {palette}: {p['totals']['avg_bits']:.2f} bits "
          f"on average, {by['total'] / 1e6:.1f} MB of tensors (original checkpoint {orig_bytes / 1e6:.1f} MB, float32)")
    for name in ("original", "compressed"):
        line = f"  {name:>10}: "
        if name in ppl:
            r = ppl[name]["perplexity"]
            line += f"WikiText-2 perplexity {r['ppl']:.2f} ({r['windows']} windows of 2048), "
        line += f"generate {speed[name]:.1f} tok/s on {device}"
        print(line)
    if not gpu:
        print("  (on CPU each quantized layer is decoded once into a dense weight while half the free "
              "memory allows, QPALETTE_CPU_DECODED_BYTES; the speed-up of the small codes comes from "
              "the CUDA kernels)")
    print(f"demo finished in {(time.time() - t_start) / 60:.1f} min")


def _shared_wikitext() -> Path | None:
    import os

    base = Path(os.environ.get("QPALETTE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    f = base / "data" / "wikitext2_raw_test.txt"
    return f if f.is_file() else None


if __name__ == "__main__":
    main()
