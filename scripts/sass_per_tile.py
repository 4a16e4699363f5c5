#!/usr/bin/env python3
"""SASS instructions a tile of each GEMV decoder, read from the compiled kernels without a GPU: the
instructions nvcc emitted from the first to the last HMMA of one main-loop round, over that round's
tiles (one HMMA a tile). The GEMVs' time follows this count (results/kernels_h100/v11/README.md).

    python scripts/sass_per_tile.py [--sources qpalette/runtime/cuda/gemv_pair_f16.cu,...] [--arch 90]
    python scripts/sass_per_tile.py --cubin kernels.cubin

Compiles each source with nvcc to a cubin (or reads --cubin), disassembles it with cuobjdump (which
needs nvdisasm on PATH) and prints one line per gemv_kernel instantiation: its decoder, the HMMAs
of one round and the instructions a tile. A round is the longest run of HMMAs at most --gap
instructions apart (the first of equal ones: the kernel holds two copies of its main loop); the
fused rotation's H_K mix, a few HMMAs in the staging before the main loop, is a shorter run. Half-TCQ
compiles both halves' decoders for every group (a branch a group): its round shows twice the tiles
it runs, and its count a tile is the two decoders' mean.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent.parent / "qpalette" / "runtime" / "cuda"
DEFAULT_SOURCES = [f"gemv_{family}_f16.cu" for family in ("tcq", "pair", "scalar", "half_tcq")]
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(\S.*?)\s*;")
FUNCTION = re.compile(r"Function : (\S+)")


def functions(sass: str) -> dict[str, list[str]]:
    """cuobjdump -sass text → {mangled function name: its instructions in order (opcode and operands)}."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        if m := FUNCTION.search(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := INSTRUCTION.match(line)):
            current.append(m.group(1))
    return out


def round_of_tiles(instructions: list[str], gap: int) -> tuple[int, float] | None:
    """(HMMAs in the longest round, instructions a tile), or None when no two HMMAs lie within `gap`."""
    at = [i for i, ins in enumerate(instructions) if re.match(r"(@!?U?P\w+\s+)?HMMA", ins)]
    runs, start = [], 0
    for end in range(1, len(at) + 1):
        if end == len(at) or at[end] - at[end - 1] > gap:
            runs.append(at[start:end])
            start = end
    best = max(runs, key=len, default=[])  # max keeps the first of equal lengths
    if len(best) < 2:
        return None
    return len(best), (best[-1] - best[0]) / (len(best) - 1)


def decoder_name(mangled: str) -> str:
    """A gemv_kernel's mangled name → its decoder(s) and dtype, e.g. "TcqLanes<4,9> f16" (half-TCQ: both
    halves' decoders)."""
    parts = re.findall(
        r"(TcqLanes|PairLanes|ScalarLanes)ILi(\d+)E(?:Li(\d+)E)?|NS1_ILi(\d+)ELi(\d+)E", mangled
    )
    names = []
    for family, a, b, ha, hb in parts:
        if family:
            names.append(f"{family}<{a},{b}>" if b else f"{family}<{a}>")
        else:  # a back-reference to the first template: half-TCQ's second decoder
            names.append(f"TcqLanes<{ha},{hb}>")
    dtype = "bf16" if "bfloat16" in mangled else "f16"
    return " + ".join(names) + f" {dtype}" if names else mangled


def compile_cubin(source: Path, arch: str, out: Path) -> None:
    cmd = [
        "nvcc",
        "-std=c++17",
        "-O3",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-cubin",
        "-o",
        str(out),
        str(source),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"nvcc failed on {source.name}: {done.stderr.strip()[:500]}")


def disassemble(cubin: Path) -> str:
    done = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(
            f"cuobjdump failed on {cubin}: {done.stderr.strip()[:300]} (nvdisasm must be on PATH)"
        )
    return done.stdout


def report(sass: str, gap: int) -> list[str]:
    lines = []
    for name, instructions in functions(sass).items():
        if "gemv_kernel" not in name:
            continue
        found = round_of_tiles(instructions, gap)
        if found is None:
            lines.append(f"{decoder_name(name):38s} no main loop found")
        else:
            hmma, per_tile = found
            lines.append(
                f"{decoder_name(name):38s} {hmma:3d} tiles a round  {per_tile:5.1f} instructions a tile"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sources",
        default=",".join(DEFAULT_SOURCES),
        help="comma-separated .cu files (names inside qpalette/runtime/cuda or paths)",
    )
    ap.add_argument("--cubin", help="read this cubin instead of compiling")
    ap.add_argument("--arch", default="90", help="compute capability to compile for (default 90: H100)")
    ap.add_argument(
        "--gap",
        type=int,
        default=500,
        help="most instructions between two HMMAs of one round (an item boundary takes ~150-220; the "
        "fused rotation's mix lies ~1000 before the loop, the loop's two copies thousands apart)",
    )
    args = ap.parse_args(argv)
    if args.cubin and not Path(args.cubin).is_file():
        print(f"no such cubin: {args.cubin}", file=sys.stderr)
        return 2
    tools = ("cuobjdump",) if args.cubin else ("nvcc", "cuobjdump")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        print(
            f"needs {' and '.join(missing)} on PATH (the CUDA toolkit; cuobjdump also needs nvdisasm)",
            file=sys.stderr,
        )
        return 2
    if args.cubin:
        cubins = [Path(args.cubin)]
    else:
        sources = [s if Path(s).is_file() else CUDA_DIR / s for s in args.sources.split(",") if s]
        absent = [str(s) for s in sources if not Path(s).is_file()]
        if absent:
            print(f"no such source: {', '.join(absent)}", file=sys.stderr)
            return 2
        tmp = Path(tempfile.mkdtemp(prefix="sass_per_tile_"))
        cubins = []
        for s in sources:
            cubins.append(tmp / (Path(s).stem + ".cubin"))
            compile_cubin(Path(s), args.arch, cubins[-1])
    for cubin in cubins:
        print(f"# {cubin.name}")
        print("\n".join(report(disassemble(cubin), args.gap)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
