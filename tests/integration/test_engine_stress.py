"""Overlap under churn: at every step new requests arrive (the queue kept at two) and now and
then a running one is cancelled, among requests that end by stop token, by length, greedy and
sampled, for hundreds of steps. Every
end frees a slot that a step launched in overlap may still read, and new admissions reuse those
slots at once: the release must wait for that step (engine_client/loop/engine.py). Each finished
step is checked as it is post-processed: a delivered row ran at its request's last token, which
gained exactly the row's tokens, and no row wrote past its request's reservation; each request
ended right (a stop token only last, nothing past max_new_tokens). At the end the KV side holds
nothing and the device reports no error. The machinery is tests/integration/churn.py (and
churn_watch.py); tests/integration/test_engine_stress_speculative.py runs it under speculative
steps.

On CUDA (gpu marker) in all four KV modes with CUDA graphs and the Triton kernels; the service
modes against a real `python -m kv_service` process (CUDA IPC, remote swap over gRPC). A short CPU
run keeps the same code paths in CI. `bench/sanitize.sh` runs the GPU cases under
compute-sanitizer (memcheck, racecheck, synccheck). STRESS_STEPS overrides the step count, a
minimum: the run goes on until every way out (stop token, length, cancel) was taken
STRESS_MIN_ENDS times (default 3), within 10 times the steps; the sanitizer's slow tools run a
few steps with STRESS_MIN_ENDS=1, and STRESS_LAYERS=1 (a one-layer model, the service's layout
too: a second layer launches the same kernels on the same shapes, repetition to racecheck and
synccheck). STRESS_QUICK_ENDS=1 (racecheck's, at ~2.8 s a step) plans each request's way out
instead of leaving it to chance, so that every way is taken within ~8 steps (churn.py's
_planned_round).
After a mode's churn a `@@sanitize-time` line says where its seconds went (service start, engine
build with its graph capture, churn steps) and how many requests ended each way: sanitize.sh's
per-mode table shows it.

With PYTORCH_NO_CUDA_MEMORY_CACHING=1 (sanitize.sh's no-caching variant, which lets memcheck see
an access past a tensor inside what would be a pooled block) the engine runs its steps eagerly:
a CUDA graph capture must not cudaMalloc, and the uncached allocator does, for every tensor the
step makes. The kernels and their launches are the same. The service keeps the caching
allocator: it exports its memory by CUDA IPC through it.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.churn import MODES, run_case

pytestmark = [pytest.mark.timeout(3600)]


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", MODES)
def test_churn_under_overlap_on_cpu(kv_mode) -> None:
    if kv_mode.startswith("service") and os.environ.get("STRESS_ALL_MODES") != "1":
        # ~4 s and ~11 s here for 80 steps (were ~15 and ~55): CI keeps to the in-process modes.
        pytest.skip("service modes on CPU only with STRESS_ALL_MODES=1 (the GPU runs all four)")
    run_case(kv_mode, "cpu", 80)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_mode", MODES)
def test_churn_under_overlap_on_gpu(kv_mode) -> None:
    run_case(kv_mode, "cuda", 600)
