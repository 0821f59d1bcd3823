#!/usr/bin/env bash
# One device call: GPU tests, then the kernel benchmark. Output files go to $OUT (or ./.gpuout).
# Usage: [KERNEL_CASES=a,b] bash bench/gpu_suite.sh [pytest selection...]
# KERNEL_CASES: only these cases of bench/kernel_cases.ALL (default: all).
set -uo pipefail
OUT=${OUT:-.gpuout}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
timeout ${GPU_TEST_BUDGET_S:-900} python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 "${@:-tests}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
python3 bench/kernels.py --out "$OUT/kernels.json" ${KERNEL_CASES:+--cases "$KERNEL_CASES"} 2>&1 | tee "$OUT/kernels.log"
