"""The overlap churn (tests/integration/test_engine_stress.py) under speculative steps
(issue 41): `--speculative mtp`, D = 3 drafts from the MTP layer, accepted by the BENCHMARK-ONLY
synthetic rule at rates (0.7, 0.5, 0.5) so that steps accept 0, 1, 2 and 3 of them (a rollback
at every depth), overlap and HiSparse's micro-batches on, CUDA graphs on GPU (the verify and
draft graphs). The same requests arrive as in the plain churn (admissions at every step, stop
tokens, lengths, cancels, greedy and sampled), prompts up to 8 tokens past the 72 hot slots that
D = 3 needs (k (D + 1) + W). The same checks (tests/integration/churn_watch.py), which
speculation puts to work: every delivered verify step ran at its request's last token and the
request gained exactly its accepted drafts and the token after (none lost or repeated), no row
(verify, the MTP layer's drafting, those of a request that ended meanwhile) wrote past the
admission's reservation (3 D - 2), every verify step had its D drafts and every depth was
accepted, a stop token is kept only last and nothing past max_new_tokens, and at the end the
KV side holds nothing.

On CUDA (gpu marker) in all four KV modes; `SANITIZE_SPEC=1 bash bench/sanitize.sh` runs the
GPU cases under memcheck (a part of its own with its own time limit; the default sanitizer run
leaves them out). On CPU the in-process modes and the service (~7 s in all on the 2-core box;
the service's run found a cancel racing an admission RPC, engine_client/loop/scheduler.py);
service-remote-swap (~7 s) with STRESS_ALL_MODES=1. STRESS_* settings as in the plain churn
(its CPU case: each way out twice). The run also goes on until every depth 0..D was accepted.
"""

from __future__ import annotations

import pytest

from tests.integration.churn import MODES, Churn, run_case, run_short_cpu_case
from tests.integration.test_engine_speculative import MIXED, SPEC_LOCAL

pytestmark = [pytest.mark.timeout(3600)]

# 16 prompt tokens a step (the plain churn's 8 took ~1.7x the steps to take every way out:
# prompts up to 79 tokens queue behind each other's prefills).
SPECULATIVE = Churn(local=SPEC_LOCAL, draft_tokens=len(MIXED), rates=MIXED, prefill_chunk=16)


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", MODES)
def test_speculative_churn_on_cpu(kv_mode, monkeypatch) -> None:
    run_short_cpu_case(kv_mode, SPECULATIVE, monkeypatch)  # each way out twice (~31 steps)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_mode", MODES)
def test_speculative_churn_on_gpu(kv_mode) -> None:
    run_case(kv_mode, "cuda", 300, SPECULATIVE)
