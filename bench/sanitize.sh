#!/usr/bin/env bash
# compute-sanitizer memcheck over the overlap churn test (tests/test_engine_stress.py, gpu cases:
# tiny preset, CUDA graphs, Triton kernels, cancels / stop tokens / admissions at every step).
# Prints the test result and the sanitizer's error count; logs go to $OUT (or ./.gpuout).
# Usage: bash bench/sanitize.sh            STRESS_STEPS=300 by default (memcheck is ~10-50x slower)
#        SANITIZE_K="gpu and embedded" bash ...   one KV mode only (pytest -k)
#        SANITIZE_NO_CACHING=1 bash ...    also bypass torch's caching allocator, so an access past
#                                          a tensor inside a pooled block is caught too
set -uo pipefail
OUT=${OUT:-.gpuout}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
export STRESS_STEPS=${STRESS_STEPS:-300}
if [ "${SANITIZE_NO_CACHING:-0}" = 1 ]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (CUDA toolkit bin/)"; exit 2; fi
LOG="$OUT/memcheck.log"
"$SAN" --tool memcheck --target-processes all --log-file "$LOG" \
  python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 3000 \
  tests/test_engine_stress.py -k "${SANITIZE_K:-gpu}" 2>&1 | tee "$OUT/sanitize_pytest.log" | tail -5
rc=${PIPESTATUS[0]}
errors=$(grep -Eo "ERROR SUMMARY: [0-9]+ error" "$LOG" | awk '{s += $3} END {print s + 0}')
summaries=$(grep -c "ERROR SUMMARY" "$LOG")
printf '\n%-28s %s\n' "memcheck processes" "$summaries" "memcheck errors" "$errors" \
  "pytest exit status" "$rc" "steps per case" "$STRESS_STEPS"
[ "$errors" = 0 ] && [ "$rc" = 0 ]
