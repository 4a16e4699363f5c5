#!/bin/bash
# GPU work of `qpalette compress` (issue 5) for the device tool, in two back-to-back calls (the
# SmolLM2-135M GGUF, 98 MB, is more than one call may carry):
#   1. carry=[".whl", ".devcarry/a"]  bash scripts/gpu_compress.sh stage
#      keeps the first half of the GGUF in /tmp, runs the GPU tests of compress/loading;
#   2. carry=[".whl", ".devcarry/b"]  bash scripts/gpu_compress.sh main
#      joins and converts the GGUF, compresses SmolLM2-135M (uniform TCQ-3.0, the 3.0-bit MSQ
#      plan in results/compress_smollm2/, uniform NUQ-3 and VQ-3.0) with peak memory, and
#      measures WikiText-2 perplexity (2048-token windows, float32) of each against the original.
# Local preparation: .devcarry/a/gguf.part0, .devcarry/b/gguf.part1 (split -b 50M of the GGUF),
# .devcarry/b/wheels/ (gguf wheel), .devcarry/b/wikitext2_raw_test.txt (from ../shared/data).
set -uo pipefail
source scripts/device_env.sh "log_compress_$1.txt"
nvidia-smi -L
QP="python3 -m qpalette.cli"

if [ "$1" = stage ]; then
    mkdir -p /tmp/qp_parts && cp .devcarry/a/gguf.part0 /tmp/qp_parts/
    timeout 300 python3 -m pytest -q -m gpu tests/test_compress.py tests/test_qlinear.py -x -p no:cacheprovider 2>&1 | tail -15
    exit 0
fi

mkdir -p /tmp/qp_model
G=/tmp/qp_model/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/qp_parts/gguf.part0 .devcarry/b/gguf.part1 > $G || { echo "part0 missing: machine was not warm"; exit 3; }
SRC=$(python3 -c "from qpalette.models import resolve_model; print(resolve_model('$G', quiet=True))")
echo "model: $SRC"
TEXT=.devcarry/b/wikitext2_raw_test.txt
PLAN=results/compress_smollm2/plan_msq_3.0bits.json
run() {  # name, compress args...
    local name=$1; shift
    /usr/bin/time -f "$name: wall %e s, peak RSS %M KB" $QP compress "$SRC" -o /tmp/q_$name --device cuda -q "$@" \
        || return 1
    cp /tmp/q_$name/qpalette-compress.json "$OUT/compress_$name.json"
}
run tcq3 --scheme tcq-3.0
run msq3 --plan $PLAN
run nuq3 --scheme nuq-3
run vq3 --scheme vq-3.0
for m in fp:$SRC tcq3:/tmp/q_tcq3 msq3:/tmp/q_msq3 nuq3:/tmp/q_nuq3 vq3:/tmp/q_vq3; do
    name=${m%%:*}; dir=${m#*:}
    [ -d "$dir" ] || continue
    $QP eval "$dir" --text-file $TEXT --ctx 2048 --device cuda --dtype float32 -q --json "$OUT/ppl_$name.json" \
        2>&1 | tail -3
done
python3 - <<'PY'
import json, glob, os
out = os.environ.get("OUT", "/tmp/out")
for f in sorted(glob.glob(f"{out}/compress_*.json")):
    r = json.load(open(f)); b = r["bytes"]
    print(os.path.basename(f), f"avg_bits {r['avg_bits']:.3f} bytes {b['total']:,} wall {r['wall_time_s']} s "
          f"peak_gpu {r['peak_gpu_bytes']/2**30:.2f} GiB peak_rss {r['peak_cpu_rss_bytes']/2**30:.2f} GiB")
PY
