#!/usr/bin/env bash
# compute-sanitizer over the overlap churn test (tests/test_engine_stress.py, gpu cases): all four
# KV modes, the service modes against a real kv_service process that the sanitizer follows too
# (--target-processes all); tiny preset, CUDA graphs, Triton kernels, cancels / stop tokens /
# admissions at every step. One run per tool:
#   memcheck   out-of-bounds and misaligned global/shared accesses, errors of CUDA API calls
#   racecheck  shared-memory hazards inside a kernel (it instruments every kernel's shared
#              accesses, Triton's included; a kernel it cannot follow is named in its log)
#   synccheck  invalid barrier and warp-sync use (what racecheck does not cover)
# Prints per tool the processes checked, the errors found and pytest's exit status; logs go to
# $OUT (or ./.gpuout). Exit status 0 only if every tool ran, found nothing, and the tests passed.
# Usage: bash bench/sanitize.sh
#        SANITIZE_TOOLS="memcheck" bash ...        a subset of the tools
#        SANITIZE_K="gpu and service" bash ...     some KV modes only (pytest -k)
#        STRESS_STEPS=300, RACECHECK_STEPS=60      steps per case (racecheck is the slowest)
#        SANITIZE_NO_CACHING=1 bash ...            the engine also bypasses torch's caching
#            allocator, so an access past a tensor inside a pooled block is caught too; its
#            steps then run eagerly (a graph capture must not cudaMalloc), the service keeps the
#            allocator (it exports CUDA IPC handles through it): see the test's docstring
set -uo pipefail
OUT=${OUT:-.gpuout}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if [ "${SANITIZE_NO_CACHING:-0}" = 1 ]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (CUDA toolkit bin/)"; exit 2; fi

# Errors a tool reported, over every process it followed.
count_errors() {
    local log=$1
    { grep -Eo "ERROR SUMMARY: [0-9]+ error" "$log" | awk '{print $3}'
      grep -Eo "RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ error" "$log" \
        | grep -Eo "\([0-9]+" | tr -d '('
    } | awk '{s += $1} END {print s + 0}'
}

status=0
printf '%-10s %10s %8s %8s %7s\n' tool processes errors pytest steps
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  steps=${STRESS_STEPS:-300}
  [ "$tool" = racecheck ] && steps=${RACECHECK_STEPS:-60}
  log="$OUT/$tool.log"
  STRESS_STEPS=$steps "$SAN" --tool "$tool" --target-processes all --log-file "$log" \
    python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 7200 \
    tests/test_engine_stress.py -k "${SANITIZE_K:-gpu}" >"$OUT/sanitize_$tool.pytest.log" 2>&1
  rc=$?
  errors=$(count_errors "$log")
  processes=$(grep -Ec "(ERROR|RACECHECK) SUMMARY" "$log")
  printf '%-10s %10s %8s %8s %7s\n' "$tool" "$processes" "$errors" "$rc" "$steps"
  tail -3 "$OUT/sanitize_$tool.pytest.log" | sed 's/^/    /'
  if [ "$errors" != 0 ] || [ "$rc" != 0 ] || [ "$processes" = 0 ]; then status=1; fi
done
exit $status
