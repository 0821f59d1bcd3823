#!/usr/bin/env bash
# compute-sanitizer over the engine's kernels and the four KV modes, within one device call. Per tool
# two parts, each under its own time limit so that one slow part cannot eat the others:
#   kernels  bench/sanitize_kernels.py: every Triton kernel entry of the engine (KernelSet),
#            launched from Python on requests of irregular lengths in both row formats, the device
#            synchronized after each launch; the findings are counted per entry in a table
#   churn    the overlap churn test (tests/integration/test_engine_stress.py, gpu cases): all four KV modes,
#            the service modes against a real kv_service process that the sanitizer follows too
#            (--target-processes all); tiny preset, CUDA graphs, cancels / stop tokens /
#            admissions at every step. STEPS is a minimum: the test goes on until every way out
#            (stop, length, cancel) was taken MIN_ENDS times, so a short run still covers them.
# Tools:
#   memcheck   out-of-bounds and misaligned global/shared accesses, errors of CUDA API calls
#   racecheck  shared-memory hazards inside a kernel (it instruments every kernel's shared
#              accesses, Triton's included; a kernel it cannot follow is named in its log); the
#              slowest tool: few churn steps
#   synccheck  invalid barrier and warp-sync use (what racecheck does not cover)
# Prints per tool and part the processes checked, the errors found, the exit status, the steps and
# seconds, then the per-kernel table; logs go to $OUT (or ./.gpuout). Exit status 0 only if every
# part ran, found nothing, and passed.
# Usage: bash bench/sanitize.sh
#        SANITIZE_TOOLS="memcheck" bash ...        a subset of the tools
#        SANITIZE_K="gpu and service" bash ...     some KV modes only (pytest -k)
#        MEMCHECK_STEPS=30 MEMCHECK_MIN_ENDS=3     memcheck's churn
#        RACECHECK_STEPS=8 RACECHECK_MIN_ENDS=1    racecheck's churn
#        SYNCCHECK_STEPS=8 SYNCCHECK_MIN_ENDS=1    synccheck's churn
#        KERNELS_S=50 CHURN_S=130                  time limits per tool (3 tools: 540 s at most)
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
rows=()
# One part under one tool: tool, part, steps, time limit, command... (its output is the log: the
# kernel table reads the sanitizer's lines between the driver's markers).
part() {
  local tool=$1 name=$2 steps=$3 limit=$4; shift 4
  local log="$OUT/sanitize_$tool.$name.log" t0=$SECONDS
  timeout -k 15 "$limit" "$SAN" --tool "$tool" --target-processes all "$@" >"$log" 2>&1
  local rc=$?
  local errors processes
  errors=$(count_errors "$log")
  processes=$(grep -Ec "(ERROR|RACECHECK) SUMMARY" "$log")
  rows+=("$(printf '%-10s %-8s %10s %8s %6s %6s %6s' "$tool" "$name" "$processes" "$errors" \
    "$rc" "$steps" "$((SECONDS - t0))")")
  echo "--- $tool $name: rc=$rc errors=$errors ($((SECONDS - t0)) s)"
  tail -3 "$log" | sed 's/^/    /'
  if [ "$errors" != 0 ] || [ "$rc" != 0 ] || [ "$processes" = 0 ]; then status=1; fi
}

for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  case $tool in
    memcheck) steps=${MEMCHECK_STEPS:-30} ends=${MEMCHECK_MIN_ENDS:-3} ;;
    racecheck) steps=${RACECHECK_STEPS:-8} ends=${RACECHECK_MIN_ENDS:-1} ;;
    *) steps=${SYNCCHECK_STEPS:-8} ends=${SYNCCHECK_MIN_ENDS:-1} ;;
  esac
  part "$tool" kernels - "${KERNELS_S:-50}" python3 bench/sanitize_kernels.py
  python3 bench/sanitize_kernels.py --table "$OUT/sanitize_$tool.kernels.log" \
    >"$OUT/sanitize_$tool.table.txt" 2>&1 || status=1
  export STRESS_STEPS=$steps STRESS_MIN_ENDS=$ends  # read by the test
  part "$tool" churn "$steps" "${CHURN_S:-130}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    --timeout 7200 tests/integration/test_engine_stress.py -k "${SANITIZE_K:-gpu}"
done

echo
printf '%-10s %-8s %10s %8s %6s %6s %6s\n' tool part processes errors rc steps secs
printf '%s\n' "${rows[@]}"
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  echo
  echo "$tool: findings per kernel entry"
  sed 's/^/    /' "$OUT/sanitize_$tool.table.txt"
done
exit $status
