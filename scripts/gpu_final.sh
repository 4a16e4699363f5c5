#!/bin/bash
# Last GPU call of the session (one call, no model carried): GPU tests of compress/loading
# (greedy text on kernels == CPU reference, compiled with a static cache) and the Llama-3.1-8B
# decode speed of FP16 vs the 2-bit plan (batch 1, 8) and the 120 tok/s speed plan (batch 1).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 QPALETTE_CACHE=/tmp/qpcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log_final.txt") 2>&1
QP="python3 -m qpalette.cli"
S8=results/speed_llama8b
timeout 150 python3 -m pytest -q -m gpu tests/test_compress.py -p no:cacheprovider 2>&1 | tail -4
python3 scripts/make_synthetic_model.py /tmp/syn8b --config llama-3.1-8b | tail -1
$QP compress /tmp/syn8b --plan $S8/plan_2bit.json --random-codes -o /tmp/syn8b_2bit -q | head -1
$QP bench /tmp/syn8b --batch-sizes 1,8 --prompt-len 16 --gen-len 32 --json "$OUT/bench_fp16.json"
$QP bench /tmp/syn8b_2bit --batch-sizes 1,8 --prompt-len 16 --gen-len 32 --json "$OUT/bench_2bit.json"
$QP compress /tmp/syn8b --plan $S8/plan_speed120.json --random-codes -o /tmp/syn8b_speed120 -q | head -1
$QP bench /tmp/syn8b_speed120 --batch-sizes 1 --prompt-len 16 --gen-len 32 --json "$OUT/bench_speed120.json"
