#!/bin/bash
# The SmolLM2-135M quality sweep of issue 7 (results/sweep_smollm2/), three back-to-back device
# calls (each under 10 min; the SmolLM2 GGUF travels in two halves). Speed, profiles, greedy
# checks and GPU tests: scripts/gpu_measure.sh.
#   A  carry=[".whl", ".devcarry/a"]  bash scripts/gpu_results.sh A   first GGUF half to /tmp
#   B  carry=[".whl", ".devcarry/b"]  bash scripts/gpu_results.sh B
#      join + convert SmolLM2-135M; sweep, uniform part (scripts/sweep_smollm2.py)
#   C  carry=[".whl"]                 bash scripts/gpu_results.sh C   sweep, MSQ part
set -uo pipefail
source scripts/device_env.sh "log_results_$1.txt"
SWEEP="python3 scripts/sweep_smollm2.py --model /tmp/qpcache/gguf-qp_model --text /tmp/wikitext2.txt
  --sens results/calibrate_smollm2/sens_gpu_8k_seed0.json --plans results/sweep_smollm2/plans
  --out /tmp/sweep.json --dtype float16 --resume"
case "$1" in
A)
    mkdir -p /tmp/qp_parts && cp .devcarry/a/gguf.part0 /tmp/qp_parts/
    ;;
B)
    G=/tmp/qp_model.gguf
    cat /tmp/qp_parts/gguf.part0 .devcarry/b/gguf.part1 > $G || { echo "part0 missing"; exit 3; }
    cp .devcarry/b/wikitext2_raw_test.txt /tmp/wikitext2.txt
    python3 -c "from qpalette.models import resolve_model; print(resolve_model('$G', quiet=True))"
    timeout 480 $SWEEP --only fp,rtn4-g128,tcq-2.0,tcq-3.0,tcq-4.0,nuq-2,nuq-3,nuq-4,vq-2.0,vq-3.0,vq-4.0
    cp /tmp/sweep.json "$OUT/"
    ;;
C)
    timeout 330 $SWEEP --only msq-2.5,msq-3.0,msq-3.5,msq-4.0
    cp /tmp/sweep.json "$OUT/"
    ;;
esac
