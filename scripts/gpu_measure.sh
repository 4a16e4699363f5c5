#!/bin/bash
# GPU measurements of issues 6 and 7 through the device tool, as steps run in order:
#   bash scripts/gpu_measure.sh STEP...      (logs and JSON in $OUT)
# part0     first half of the SmolLM2 GGUF to /tmp (carry .devcarry/a; `greedy` later on the same
#           warm machine carries .devcarry/b with the second half)
# syn8b     random-weight Llama-3.1-8B checkpoint + the plans of results/speed_llama8b compressed
#           with --random-codes (in the background when BG=1; `wait8b` waits for it)
# kn        the kernels-next overlay (.kn, carried): build and GPU kernel tests; knab: TCQ table A/B bench
# greedy    SmolLM2-135M TCQ-3.0 compressed on the GPU: greedy text on the kernels (eager and
#           compiled with a static cache) vs the CPU reference (scripts/check_greedy.py)
# bench     `qpalette bench` (generate and forward loop) of BENCH="fp16:1,8 2bit:1,8 ..."
# breakdown scripts/decode_breakdown.py of BREAKDOWN="fp16 2bit" at batch 1
# gputests  pytest -m gpu over the whole suite
# profile   `qpalette profile` of Llama-3.1-8B and SmolLM2-135M shapes (carry .devcarry/smollm2), batch 1
#           and 8, written over profiles/h100_latency_* of this copy
# plans     (carry .devcarry/ort: OR-Tools wheels) the Llama-3.1-8B plans re-made with the new profile:
#           2bit, 4bit and speed budgets SPEEDS="150 170" (plan_speed150 ...); compressed with
#           --random-codes in the background; profiles and plans come back in $OUT/profiles_plans.tar
set -uo pipefail
T0=$(date +%s)
source scripts/device_env.sh "log_measure.txt"
QP="python3 -m qpalette.cli"
S8=results/speed_llama8b
model_dir() { [ "$1" = fp16 ] && echo /tmp/syn8b || echo /tmp/syn8b_$1; }
only_syn8b() { [ -d /tmp/syn8b ] || python3 scripts/make_synthetic_model.py /tmp/syn8b --config llama-3.1-8b | tail -1
               touch /tmp/syn8b.done; }
syn8b() {
    [ -d /tmp/syn8b ] || python3 scripts/make_synthetic_model.py /tmp/syn8b --config llama-3.1-8b | tail -1
    for p in ${PLANS:-2bit 4bit speed150 speed170}; do
        [ -d /tmp/syn8b_$p ] || $QP compress /tmp/syn8b --plan $S8/plan_$p.json --random-codes -o /tmp/syn8b_$p -q | head -1
    done
}
for step in "$@"; do
  echo "=== $step at $(( $(date +%s) - T0 )) s"
  case $step in
    part0) mkdir -p /tmp/qp_parts && cp .devcarry/a/gguf.part0 /tmp/qp_parts/ ;;
    syn8b) if [ "${BG:-0}" = 1 ]; then syn8b > "$OUT/log_syn8b.txt" 2>&1 & SYNPID=$!; else syn8b; fi ;;
    only8b) only_syn8b > "$OUT/log_syn8b.txt" 2>&1 & ;;
    waitall) wait $(jobs -p); cat "$OUT"/log_*.txt 2>/dev/null | grep -E "^(wrote|done)" ;;
    wait8b) [ -n "${SYNPID:-}" ] && wait $SYNPID; cat "$OUT/log_syn8b.txt" 2>/dev/null | grep -v Warning ;;
    kn)
      rm -rf /tmp/kn && mkdir /tmp/kn && cp -r .whl kernels qpalette scripts tests profiles pyproject.toml /tmp/kn/ \
        && cp -r .kn/. /tmp/kn/ || exit 1
      (cd /tmp/kn && OUT="$OUT/kn" TEST_LIMIT=${KN_TEST_LIMIT:-240} bash scripts/gpu_kernels.sh build tests) ;;
    knab) (cd /tmp/kn && OUT="$OUT/kn" bash scripts/gpu_kernels.sh abtcq) ;;
    greedy)
      G=/tmp/qp_model.gguf
      cat /tmp/qp_parts/gguf.part0 .devcarry/b/gguf.part1 > $G || { echo "part0 missing: machine was not warm"; exit 3; }
      SRC=$(python3 -c "from qpalette.models import resolve_model; print(resolve_model('$G', quiet=True))")
      [ -d /tmp/q_tcq3 ] || [ -n "${GREEDY_ORIGINAL:-}" ] || $QP compress "$SRC" --scheme tcq-3.0 -o /tmp/q_tcq3 --device cuda -q | head -1
      [ -n "${GREEDY_ORIGINAL:-}" ] && timeout 200 python3 scripts/check_greedy.py "$SRC" --json "$OUT/greedy_smollm2_original.json"
      [ -n "${GREEDY_ORIGINAL:-}" ] || timeout ${GREEDY_LIMIT:-400} python3 scripts/check_greedy.py /tmp/q_tcq3 --json "$OUT/greedy_smollm2_tcq3.json" ;;
    bench)
      for mb in ${BENCH:-fp16:1,8 2bit:1,8}; do
        m=${mb%%:*}; b=${mb#*:}
        timeout ${BENCH_ONE_LIMIT:-300} $QP bench $(model_dir $m) --batch-sizes $b --prompt-len 16 --gen-len 32 \
          --json "$OUT/bench_$m.json" 2>&1 | grep -E "batch|rror|Traceback"
      done ;;
    breakdown)
      for m in ${BREAKDOWN:-fp16 2bit}; do
        timeout 240 python3 scripts/decode_breakdown.py $(model_dir $m) --json "$OUT/breakdown_$m.json" 2>&1 \
          | grep -v -i warn
      done ;;
    profile)
      for mdl in smollm2 llama; do
        case $mdl in
          smollm2) src=.devcarry/smollm2; name=smollm2-135m; ship=smollm2-135m ;;
          llama) src=profiles/reference/llama31_8b/config.json; name=meta-llama/Llama-3.1-8B; ship=llama31_8b ;;
        esac
        timeout 400 $QP profile $src --batch-sizes 1,8 -o /tmp/prof --name $name 2>&1 | grep -v -i warn || exit 1
        for b in 1 8; do cp /tmp/prof/latency_$(echo ${name##*/} | tr A-Z a-z)_b$b.json profiles/h100_latency_${ship}_b$b.json; done
      done
      ls -la profiles/h100_latency_* ;;
    plans)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/ort/*.whl || exit 1
      mkdir -p /tmp/plans
      P="profiles/reference/llama31_8b -s profiles/reference/llama31_8b_sensitivity.json -l profiles/h100_latency_llama31_8b_b1.json --no-plot"
      for b in 2bits 4bits $(for v in ${SPEEDS:-150 170}; do echo ${v}tok/s; done); do
        n=$(echo $b | sed 's/bits/bit/; s/tok\/s//; s/^\([0-9]*\)$/speed\1/')
        $QP plan $P -b $b -o /tmp/plans/plan_$n.json 2>&1 | grep -v -i warn | tail -3
      done
      tar cf "$OUT/profiles_plans.tar" profiles/h100_latency_* -C /tmp plans
      for v in ${SPEEDS:-150 170}; do
        ( [ -d /tmp/syn8b_speed$v ] || { while [ ! -f /tmp/syn8b.done ]; do sleep 5; done;
          $QP compress /tmp/syn8b --plan /tmp/plans/plan_speed$v.json --random-codes -o /tmp/syn8b_speed$v -q | head -1; } ) \
          > "$OUT/log_compress_speed$v.txt" 2>&1 &
      done ;;
    gputests)
      timeout ${TEST_LIMIT:-500} python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15 ;;
  esac
done
echo "=== done at $(( $(date +%s) - T0 )) s"
