#!/usr/bin/env bash
# One device call that batches this session's GPU work: the gpu-marked tests, compute-sanitizer
# (memcheck, racecheck, synccheck; SANITIZE_TOOLS picks) over the overlap churn test in all four
# KV modes, kernel benchmark cases and a profile of one decode step. Each stage has its
# own time limit, so one slow stage cannot eat the others; logs and JSON go to $OUT.
# Usage: bash bench/gpu_session.sh [stage ...]   stages: tests sanitize kernels profile e2e
#   TESTS="tests/x.py ..."  TEST_S=240  TEST_TIMEOUT=150  SAN_S=540  KERN_S=100  PROF_S=100
#   E2E_S=480  KERNEL_CASES=miss_copy,attention_formats (empty: all)  KERNEL_QUICK=--quick (empty:
#   full sizes)  PROFILE_ARGS="--batch 64"  E2E_ARGS="..."
set -uo pipefail
OUT=${OUT:-.gpuout}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
summary=()
stage() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -25 "$OUT/$name.log"
  summary+=("$(printf '%-10s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^=]*' "$OUT/$name.log" | tail -1)")")
}
STAGES="${*:-tests sanitize kernels profile}"
for s in $STAGES; do
  case $s in
    tests) stage tests "${TEST_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             --timeout "${TEST_TIMEOUT:-150}" ${TESTS:-tests} ;;
    sanitize) stage sanitize "${SAN_S:-540}" env STRESS_STEPS=${STRESS_STEPS:-60} \
                RACECHECK_STEPS=${RACECHECK_STEPS:-20} bash bench/sanitize.sh ;;
    kernels) stage kernels "${KERN_S:-100}" python3 bench/kernels.py ${KERNEL_QUICK---quick} \
               --cases "${KERNEL_CASES-miss_copy,attention_formats}" --out "$OUT/kernels.json" ;;
    profile) stage profile "${PROF_S:-100}" python3 bench/profile.py --preset bench \
               --context 32768 --mode embedded --warmup 8 ${PROFILE_ARGS:---batch 64} \
               --out "$OUT/profile.json" ;;
    e2e) stage e2e "${E2E_S:-480}" python3 bench/e2e.py ${E2E_ARGS:-} --out "$OUT/e2e.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
