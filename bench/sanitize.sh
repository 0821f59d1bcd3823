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
# seconds, then per tool the findings per kernel entry and per KV mode (the churn test prints a
# marker as each mode starts: what the sanitizer reports after it, service process included, is
# that mode's); logs go to $OUT (or ./.gpuout). Exit status 0 only if every part ran, found
# nothing, and passed, and every mode passed.
# Every process, the service the churn starts included, uses the CUDA tools that Triton resolves
# here before any sanitizer runs (TRITON_PTXAS_PATH...: kernels/toolchain.py): under
# --target-processes all the service once could not find ptxas.
# Usage: bash bench/sanitize.sh
#        SANITIZE_TOOLS="memcheck" bash ...        a subset of the tools
#        SANITIZE_K="gpu and service" bash ...     some KV modes only (pytest -k)
#        MEMCHECK_STEPS=30 MEMCHECK_MIN_ENDS=3     memcheck's churn
#        RACECHECK_STEPS=8 RACECHECK_MIN_ENDS=1    racecheck's churn
#        SYNCCHECK_STEPS=8 SYNCCHECK_MIN_ENDS=1    synccheck's churn
#        MEMCHECK_KERNELS_S=40 MEMCHECK_CHURN_S=80 time limits per tool and part (likewise
#            RACECHECK_*: 150, 130; SYNCCHECK_*: 35, 55; KERNELS_S / CHURN_S set every tool's):
#            490 s of parts, each killed 5 s after its limit, fits one 600 s device call
#        SANITIZE_NO_CACHING=1 bash ...            the engine also bypasses torch's caching
#            allocator, so an access past a tensor inside a pooled block is caught too; its
#            steps then run eagerly (a graph capture must not cudaMalloc), the service keeps the
#            allocator (it exports CUDA IPC handles through it): see the test's docstring
set -uo pipefail
OUT=${OUT:-.gpuout}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if [ "${SANITIZE_NO_CACHING:-0}" = 1 ]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi
# The CUDA tools Triton finds outside any sanitizer, named for every process started below.
eval "$(python3 -c 'import triton; from kernels import toolchain
for k, v in toolchain.child_env().items(): print(f"export {k}={v}")')"
env | grep '^TRITON_.*_PATH=' || echo "Triton named no CUDA tool here"
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
  timeout -k 5 "$limit" "$SAN" --tool "$tool" --target-processes all "$@" >"$log" 2>&1
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
    memcheck) steps=${MEMCHECK_STEPS:-30} ends=${MEMCHECK_MIN_ENDS:-3}
      kernels_s=${MEMCHECK_KERNELS_S:-${KERNELS_S:-40}} churn_s=${MEMCHECK_CHURN_S:-${CHURN_S:-80}} ;;
    racecheck) steps=${RACECHECK_STEPS:-8} ends=${RACECHECK_MIN_ENDS:-1}
      kernels_s=${RACECHECK_KERNELS_S:-${KERNELS_S:-150}}
      churn_s=${RACECHECK_CHURN_S:-${CHURN_S:-130}} ;;
    *) steps=${SYNCCHECK_STEPS:-8} ends=${SYNCCHECK_MIN_ENDS:-1}
      kernels_s=${SYNCCHECK_KERNELS_S:-${KERNELS_S:-35}} churn_s=${SYNCCHECK_CHURN_S:-${CHURN_S:-55}} ;;
  esac
  part "$tool" kernels - "$kernels_s" python3 bench/sanitize_kernels.py
  python3 bench/sanitize_kernels.py --table "$OUT/sanitize_$tool.kernels.log" \
    >"$OUT/sanitize_$tool.table.txt" 2>&1 || status=1
  export STRESS_STEPS=$steps STRESS_MIN_ENDS=$ends  # read by the test
  # -s: the test's mode markers reach the log between the sanitizer's lines; -rA: a line per mode.
  part "$tool" churn "$steps" "$churn_s" python3 -m pytest -q -s -rA -m gpu -p no:cacheprovider \
    --timeout 7200 tests/integration/test_engine_stress.py -k "${SANITIZE_K:-gpu}"
  python3 bench/sanitize_kernels.py --modes "$OUT/sanitize_$tool.churn.log" \
    >"$OUT/sanitize_$tool.modes.txt" 2>&1 || status=1
done

echo
printf '%-10s %-8s %10s %8s %6s %6s %6s\n' tool part processes errors rc steps secs
printf '%s\n' "${rows[@]}"
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  echo
  echo "$tool: findings per kernel entry"
  sed 's/^/    /' "$OUT/sanitize_$tool.table.txt"
  echo "$tool: findings per KV mode (churn)"
  sed 's/^/    /' "$OUT/sanitize_$tool.modes.txt"
done
exit $status
