#!/bin/bash
# GPU work of the kernels issue (6) in one device-tool call (carry [".whl"]):
#   scripts/gpu_kernels.sh [build] [tests] [bench] [benchall] [sass]
# build: compile the extension (timed); tests: pytest -m gpu tests/test_kernels.py;
# bench: scripts/bench_kernels.py on the target entries; benchall: every entry. Logs in $OUT.
set -uo pipefail
T0=$(date +%s)
source scripts/device_env.sh "log.txt"
export MAX_JOBS=16
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv,noheader
echo "ninja: $(command -v ninja)"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build tests bench)
for step in "${steps[@]}"; do
  echo "=== $step at $(( $(date +%s) - T0 )) s"
  case $step in
    build)
      QPALETTE_KERNELS_VERBOSE=${VERBOSE:-0} python3 -c "
import time, torch; t=time.time()
from qpalette import kernels; kernels.extension()
print(f'kernels built in {time.time()-t:.1f} s for sm_{kernels.arch_of()}')" || exit 1 ;;
    tests)
      timeout ${TEST_LIMIT:-300} python3 -m pytest -q -m gpu tests/test_kernels.py -x -p no:cacheprovider \
        ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -40 ;;
    bench)
      timeout ${BENCH_LIMIT:-200} python3 scripts/bench_kernels.py --out "$OUT" \
        --entries "${BENCH_ENTRIES:-tcq-2.0,tcq-3.0,tcq-4.0,nuq-4,vq-4.0,half-tcq-3.25,vq-2.0,nuq-8}" \
        --shapes "${BENCH_SHAPES:-all}" | tail -60 ;;
    benchall)
      timeout ${BENCH_LIMIT:-400} python3 scripts/bench_kernels.py --out "$OUT" | tail -5 ;;
    sass)
      for f in qmm_tcq_f16 qmm_pair_f16; do
        cuobjdump -sass /tmp/qpcache/kernels/*/$f.cuda.o > "$OUT/sass_$f.txt"; done ;;
    profile)  # PROFILE_MODELS: smollm2 (carry .devcarry/smollm2) and/or llama; PROFILE_ENTRIES: all
      for mdl in ${PROFILE_MODELS:-smollm2 llama}; do
        case $mdl in
          smollm2) src=.devcarry/smollm2; name=smollm2-135m ;;
          llama) src=profiles/reference/llama31_8b/config.json; name=meta-llama/Llama-3.1-8B ;;
        esac
        timeout ${PROFILE_LIMIT:-400} python3 -c "
import sys; from qpalette.profile_command import run_profile
e = '${PROFILE_ENTRIES:-}'
run_profile('$src', [int(b) for b in '${PROFILE_BATCHES:-1,8}'.split(',')], '$OUT', name='$name',
            entries=e.split(',') if e else None)" || echo "profile $mdl failed"
      done ;;
    ncu)
      timeout 200 ncu -k regex:qmm_kernel --launch-skip 1 --launch-count ${NCU_COUNT:-2} \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
        python3 scripts/kernel_probe.py ${NCU_ENTRIES:-tcq-2.0 vq-2.0} > "$OUT/ncu.txt" 2>&1
      grep -E "qmm_kernel|Duration|DRAM Throughput|Issued Warp|Eligible Warps|inst_executed" "$OUT/ncu.txt" | head -20
      grep -E "issue_stalled" "$OUT/ncu.txt" | sort -k3 -g -r | head -12 ;;
  esac
done
echo "=== done at $(( $(date +%s) - T0 )) s"
