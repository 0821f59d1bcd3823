"""The overlap churn (tests/integration/test_engine_stress.py) on a layout with host reads
(issue 40: KVLayout.host_reads): a private hot buffer of W + 4 = 12 rows for top-k 16, so every
offloaded step whose selection holds more than 4 rows outside the window reads the rest from the
host tier, plain and under speculative steps (D = 3: the verify union overflows further). The
same requests, ends and checks as the plain churn (tests/integration/churn_watch.py); at the end
the KV side holds nothing. A host row named past the host tier would show under
`SANITIZE_TESTS=tests/integration/test_engine_stress_host_reads.py bash bench/sanitize.sh`
(memcheck). The baseline has no hot buffer, so only the HiSparse modes run.

CPU: embedded (service modes with STRESS_ALL_MODES=1); GPU (gpu marker): the three HiSparse
modes with CUDA graphs and micro-batches, the service modes against a real service process."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.integration.churn import Churn, run_case, run_short_cpu_case
from tests.integration.test_engine_speculative import MIXED, SPEC_LOCAL
from tests.process_harness import LOCAL

pytestmark = [pytest.mark.timeout(3600)]

HISPARSE = ["embedded", "service", "service-remote-swap"]


def _small(local):
    return dataclasses.replace(local, hot_slots=local.window + 4, host_reads=True)


CHURNS = {
    "plain": Churn(local=_small(LOCAL)),
    "speculative": Churn(
        local=_small(SPEC_LOCAL), draft_tokens=len(MIXED), rates=MIXED, prefill_chunk=16
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("churn", list(CHURNS))
@pytest.mark.parametrize("kv_mode", HISPARSE)
def test_host_reads_churn_on_cpu(kv_mode, churn, monkeypatch) -> None:
    if kv_mode != "embedded" and os.environ.get("STRESS_ALL_MODES") != "1":
        pytest.skip("service modes on CPU only with STRESS_ALL_MODES=1 (the GPU runs them)")
    run_short_cpu_case(kv_mode, CHURNS[churn], monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("churn", list(CHURNS))
@pytest.mark.parametrize("kv_mode", HISPARSE)
def test_host_reads_churn_on_gpu(kv_mode, churn) -> None:
    run_case(kv_mode, "cuda", 300, CHURNS[churn])
