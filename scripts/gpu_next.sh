#!/bin/bash
# What the session's device time did not cover (issues 6 and 7), two back-to-back calls:
#   A  carry=[".whl", ".devcarry/a"]  bash scripts/gpu_next.sh A
#      first GGUF half to /tmp; Llama-3.1-8B-shape decode speed of the 4-bit and 120 tok/s plans
#      (batch 1) and the 2-bit plan at batch 8 (results/speed_llama8b/, FP16 measured already)
#   B  carry=[".whl", ".devcarry/b"]  bash scripts/gpu_next.sh B
#      SmolLM2-135M compressed with TCQ-3.0 on the GPU: greedy text on the kernels (eager and
#      compiled with a static cache) vs the CPU reference (scripts/check_greedy.py)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .devcarry/b/wheels/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 QPALETTE_CACHE=/tmp/qpcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log_next_$1.txt") 2>&1
QP="python3 -m qpalette.cli"
S8=results/speed_llama8b
case "$1" in
A)
    mkdir -p /tmp/qp_parts && cp .devcarry/a/gguf.part0 /tmp/qp_parts/
    [ -d /tmp/syn8b ] || python3 scripts/make_synthetic_model.py /tmp/syn8b --config llama-3.1-8b | tail -1
    for p in 4bit speed120 2bit; do
        [ -d /tmp/syn8b_$p ] || $QP compress /tmp/syn8b --plan $S8/plan_$p.json --random-codes -o /tmp/syn8b_$p -q | head -1
    done
    $QP bench /tmp/syn8b_4bit --batch-sizes 1 --prompt-len 16 --gen-len 32 --json "$OUT/bench_4bit.json"
    $QP bench /tmp/syn8b_speed120 --batch-sizes 1 --prompt-len 16 --gen-len 32 --json "$OUT/bench_speed120.json"
    $QP bench /tmp/syn8b_2bit --batch-sizes 1,8 --prompt-len 16 --gen-len 32 --json "$OUT/bench_2bit.json"
    ;;
B)
    G=/tmp/qp_model.gguf
    cat /tmp/qp_parts/gguf.part0 .devcarry/b/gguf.part1 > $G || { echo "part0 missing: machine was not warm"; exit 3; }
    SRC=$(python3 -c "from qpalette.models import resolve_model; print(resolve_model('$G', quiet=True))")
    $QP compress "$SRC" --scheme tcq-3.0 -o /tmp/q_tcq3 --device cuda -q | head -1
    timeout 400 python3 scripts/check_greedy.py /tmp/q_tcq3 --json "$OUT/greedy_smollm2_tcq3.json"
    ;;
esac
