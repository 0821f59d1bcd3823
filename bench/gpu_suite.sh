#!/usr/bin/env bash
# GPU tests, then the whole kernel benchmark at full sizes, in one device call; kept for the
# commands recorded in docs/BENCHMARKS.md. bench/gpu_session.sh does the work; output in $OUT.
# Usage: [KERNEL_CASES=a,b] [GPU_TEST_BUDGET_S=900] bash bench/gpu_suite.sh [pytest selection...]
TESTS="${*:-tests}" TEST_S=${GPU_TEST_BUDGET_S:-900} TEST_TIMEOUT=300 KERN_S=${KERN_S:-1800} \
  KERNEL_CASES="${KERNEL_CASES:-}" KERNEL_QUICK="" exec bash "$(dirname "$0")/gpu_session.sh" tests kernels
