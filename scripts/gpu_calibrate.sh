#!/bin/bash
# GPU work of `qpalette calibrate` (issue 3) for the device tool, in two calls because the
# SmolLM2-135M GGUF (98 MB) is larger than what one call may carry (64 MiB):
#   1. carry=[".whl", ".devcarry/a"]  scripts/gpu_calibrate.sh stage
#      keeps the first half of the GGUF in /tmp on the machine, runs the GPU tests of calibrate
#      on a tiny Llama and a speed probe on a random model of SmolLM2's shapes;
#   2. carry=[".whl", ".devcarry/b"]  QP_SEQS=64 scripts/gpu_calibrate.sh main
#      (right after, while the machine is warm) joins the GGUF, converts it, calibrates with two
#      seeds, validates the linearity theorem on random quantized mixes; results in $OUT.
# Local preparation: split -b 50M of the GGUF into .devcarry/a/gguf.part0, .devcarry/b/gguf.part1
# and the gguf wheel into .devcarry/b/wheels/.
set -uo pipefail
T0=$(date +%s)
LIMIT=${QP_LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
lim() { local v=$(( $(left) - $1 )); [ $v -lt 10 ] && v=10; echo $v; }
source scripts/device_env.sh "log_$1.txt"
nvidia-smi -L
QP="python3 -m qpalette.cli calibrate"

if [ "$1" = stage ]; then
    mkdir -p /tmp/qp_parts && cp .devcarry/a/gguf.part0 /tmp/qp_parts/ && ls -la /tmp/qp_parts
    python3 -c "import sys; sys.path.insert(0, 'tests'); from tiny_llama import *
make_tiny_llama('/tmp/tiny'); make_tiny_llama('/tmp/smolrand', **SMOLLM2_SHAPES)"
    $QP /tmp/tiny -o "$OUT/tiny_cuda.json" --device cuda -n 8 --seq-len 64 -q
    timeout 100 python3 -m pytest -q -m gpu tests/test_calibrate.py -x -p no:cacheprovider 2>&1 | tail -15
    $QP /tmp/smolrand -o "$OUT/probe.json" --device cuda -n 64 --seq-len 512 --levels 4 -q \
        --layers 'layers\.(0|29)\.mlp\.down_proj'
    python3 -c "import json; d=json.load(open('$OUT/probe.json')); print({n: v['seconds'] for n, v in d['layers'].items()}, d['timing'])"
    exit 0
fi

# main
mkdir -p /tmp/qp_model
G=/tmp/qp_model/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/qp_parts/gguf.part0 .devcarry/b/gguf.part1 > $G || { echo "part0 missing: machine was not warm"; exit 3; }
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
MODEL=$(python3 -c "from qpalette.models import resolve_model; print(resolve_model('$G'))") || exit 4
N=${QP_SEQS:-64}
for s in 0 1; do
    timeout $(lim 120) $QP "$MODEL" -o "$OUT/sens_seed$s.json" --device cuda -n $N --seq-len 512 --seed $s -q
done
python3 scripts/calib_summary.py "$OUT/sens_seed0.json" "$OUT/sens_seed1.json" | tee "$OUT/summary.json"
timeout $(lim 5) python3 scripts/validate_linearity.py --model "$MODEL" --sens "$OUT/sens_seed0.json" \
    --sens "$OUT/sens_seed1.json" --mixes ${QP_MIXES:-12} --num-seqs 32 --seq-len 512 --out "$OUT/validation.json"
echo "main done in $(( $(date +%s) - T0 )) s"
