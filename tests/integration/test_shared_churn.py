"""The overlap churn (tests/integration/test_engine_stress.py) with shared prefixes (issue 40):
prompts start with one of two 24-token prefixes, so admissions map cached pages and decode
steps read their rows through the shared hot region (--shared-slots: the embedded engine's, the
service's), while requests arrive, stop, end by length and are cancelled at every step. Besides
the churn's own checks, tests/integration/churn_shared.py checks the books and every request's
`shared_len` after each step, every selected row's bytes and the region's table after each
decode layer (CPU), and at the end that sharing happened, a Flush empties the pools and the
region, and the engine's detach leaves the service's region empty.

CPU: embedded, baseline (prefix sharing without a region) and service (the in-stream holder of
the service's region), ~5 s in all on the 2-core box (~48 steps a mode); service-remote-swap
(the service plans with its region; ~12 s: a remote swap per layer) with STRESS_ALL_MODES=1.
GPU (gpu marker): all four modes, CUDA graphs, for compute-sanitizer:
`SANITIZE_TESTS=tests/integration/test_shared_churn.py SANITIZE_TOOLS=memcheck bash
bench/sanitize.sh`. STRESS_* settings as in the plain churn (its CPU case here: each way out
twice).
"""

from __future__ import annotations

import pytest

from tests.integration.churn import MODES, run_case, run_short_cpu_case
from tests.integration.churn_shared import SHARED_CHURN

pytestmark = [pytest.mark.timeout(3600)]


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", MODES)
def test_shared_churn_on_cpu(kv_mode, monkeypatch) -> None:
    run_short_cpu_case(kv_mode, SHARED_CHURN, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_mode", MODES)
def test_shared_churn_on_gpu(kv_mode) -> None:
    run_case(kv_mode, "cuda", 300, SHARED_CHURN)
