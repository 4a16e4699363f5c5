#!/bin/bash
# GPU work of issue 7 (and the integration checks of issue 6), three back-to-back device calls
# (each under 10 min; the SmolLM2 GGUF travels in two halves):
#   A  carry=[".whl", ".devcarry/a"]  bash scripts/gpu_results.sh A
#      first GGUF half to /tmp; synthetic Llama-3.1-8B (random weights), compressed with
#      --random-codes per the plans in results/speed_llama8b/; `qpalette bench` FP16 and 2-bit
#   B  carry=[".whl", ".devcarry/b"]  bash scripts/gpu_results.sh B
#      join + convert SmolLM2-135M; quality sweep, uniform part (scripts/sweep_smollm2.py);
#      greedy-text check of a TCQ-3.0 checkpoint (CPU reference vs GPU kernels vs compiled)
#   C  carry=[".whl"]                 bash scripts/gpu_results.sh C
#      sweep, MSQ part; bench of the 4-bit and speed-budget 8B plans
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .devcarry/b/wheels/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 QPALETTE_CACHE=/tmp/qpcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log_results_$1.txt") 2>&1
QP="python3 -m qpalette.cli"
S8=results/speed_llama8b
bench8() { $QP bench /tmp/syn8b${1:+_$1} --batch-sizes 1,8 --prompt-len 32 --gen-len 64 --json "$OUT/bench_${1:-fp16}.json"; }
SWEEP="python3 scripts/sweep_smollm2.py --model /tmp/qpcache/gguf-qp_model --text /tmp/wikitext2.txt
  --sens results/calibrate_smollm2/sens_gpu_8k_seed0.json --plans results/sweep_smollm2/plans
  --out /tmp/sweep.json --dtype float16 --resume"
case "$1" in
A)
    mkdir -p /tmp/qp_parts && cp .devcarry/a/gguf.part0 /tmp/qp_parts/
    [ -d /tmp/syn8b ] || python3 scripts/make_synthetic_model.py /tmp/syn8b --config llama-3.1-8b
    for p in 2bit 4bit speed120; do
        [ -d /tmp/syn8b_$p ] || /usr/bin/time -f "compress $p: %e s" \
            $QP compress /tmp/syn8b --plan $S8/plan_$p.json --random-codes -o /tmp/syn8b_$p -q
    done
    bench8 ""; bench8 2bit
    ;;
B)
    G=/tmp/qp_model.gguf
    cat /tmp/qp_parts/gguf.part0 .devcarry/b/gguf.part1 > $G || { echo "part0 missing"; exit 3; }
    cp .devcarry/b/wikitext2_raw_test.txt /tmp/wikitext2.txt
    python3 -c "from qpalette.models import resolve_model; print(resolve_model('$G', quiet=True))"
    timeout 480 $SWEEP --only fp,rtn4-g128,tcq-2.0,tcq-3.0,tcq-4.0,nuq-2,nuq-3,nuq-4,vq-2.0,vq-3.0,vq-4.0 --keep tcq-3.0
    timeout 100 python3 scripts/check_greedy.py /tmp/qp_sweep/tcq-3.0 --json "$OUT/greedy_tcq3.json"
    cp /tmp/sweep.json "$OUT/"
    ;;
C)
    timeout 330 $SWEEP --only msq-2.5,msq-3.0,msq-3.5,msq-4.0
    cp /tmp/sweep.json "$OUT/"
    bench8 4bit; bench8 speed120
    ;;
esac
