#!/usr/bin/env bash
# One device-tool call for the foundation issue: build codebooks on CUDA (optional), measure the
# distortion table, time TCQ quantization, run the GPU tests. Results land in $OUT.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/qpalette-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
step=${1:-all}
if [[ $step == codebooks || $step == all ]]; then
  python3 scripts/build_codebooks.py --device cuda --out "$OUT"
  cp "$OUT/codebooks.safetensors" profiles/
fi
if [[ $step == bench || $step == all ]]; then
  python3 scripts/bench_quantize.py --quantizers "${BENCH_Q:-tcq-2.0,tcq-4.0}" --json "$OUT/bench_quantize_gpu.json"
fi
if [[ $step == table || $step == all ]]; then
  python3 -m qpalette.cli palette --measure --rows "${TABLE_ROWS:-4096}" --cols "${TABLE_COLS:-4096}" \
    --device cuda --write "$OUT/distortion_gaussian.json"
fi
if [[ $step == tests || $step == all ]]; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log"
fi
