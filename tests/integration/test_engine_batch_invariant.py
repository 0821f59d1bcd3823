"""--batch-invariant 1 on CUDA: greedy MTP decoding equals plain decoding bit for bit in every KV
mode. Without it a verify step runs n (D + 1) rows through each GEMM where plain decoding runs n,
cuBLAS picks another kernel or split-K, and the streams part after a few tokens (issue 41: 1-8%
of MTP streams equal plain decoding on the H200).

Real drafts (the MTP layer's, checked by the target): every token of a greedy stream equals the
plain run's, and so do the fp32 logits that chose it, whichever step and row produced them (row 0
of a verify step, or a later row after accepted drafts). Synthetic acceptance 1.0 (every draft
taken; the stream is then the drafts', not plain decoding's): each token the target chose equals
a plain engine's greedy continuation of the stream before it, prompted with that stream (tokens
only: that engine prefills the stream, and prefill attention sums in another order)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from contract import setting_groups
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import MODES, _drive, _run_jobs, one_cpu_thread  # noqa: F401 (autouse)
from tests.integration.test_engine_speculative import (
    GREEDY,
    JOBS,
    SPEC_LAYOUT,
    _run_recorded,
    spec_config,
)
from tests.process_harness import engine_config, flush, start_service, workdir

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]


def on_gpu(cfg, row_format: str):
    local = dataclasses.replace(cfg.local, row_format=row_format)
    return setting_groups.replace(
        cfg, device="cuda", local=local, batch_invariant=True, overlap=False
    )


async def _row_logits(cfg, jobs) -> tuple[list[list[int]], dict]:
    """Tokens of every job, and {(job, token index): the logits row that chose it} of every
    decode row whose token was kept (a verify step's rows 0..accepted)."""
    engine = await build_engine(cfg)
    step, post = engine.compute.model_runner.step, engine.postprocess
    last: list[torch.Tensor] = []
    rows: dict[tuple[str, int], torch.Tensor] = {}

    def recording_step(*args):
        last[:] = [step(*args).clone()]
        return last[0]

    def recording_post(out) -> None:
        accepted = out.accepted or [0] * len(out.batch.decode)
        g = last[0].shape[0] // max(1, len(out.batch.decode)) if out.batch.decode else 1
        for i, (req, a) in enumerate(zip(out.batch.decode, accepted)):
            for j in range(a + 1):
                rows[(req.request_id, len(req.tokens) + j)] = last[0][i * g + j]
        post(out)

    engine.compute.model_runner.step = recording_step
    engine.postprocess = recording_post
    reqs = await _drive(engine, jobs)
    by_job = {
        (j, i): t for j, r in enumerate(reqs) for (rid, i), t in rows.items() if rid == r.request_id
    }
    return [r.tokens for r in reqs], by_job


def _check_equal(plain, spec, mode: str) -> None:
    (p_tokens, p_rows), (s_tokens, s_rows) = plain, spec
    for j in GREEDY:
        assert s_tokens[j] == p_tokens[j], (mode, j)
        keys = [k for k in p_rows if k[0] == j]
        assert keys and all(k in s_rows for k in keys), (mode, j)
        assert all(torch.equal(p_rows[k], s_rows[k]) for k in keys), (mode, j)


def _teacher_forced_gpu(row_format: str, tokens, picked) -> None:
    forced = [
        ((JOBS[j][0] + tuple(tokens[j][:i]), 1, JOBS[j][2]), tokens[j][i])
        for j in GREEDY
        for i in picked[j]
    ]
    cfg = on_gpu(engine_config("baseline"), row_format)
    got, _, _ = asyncio.run(_run_jobs(cfg, [f for f, _ in forced]))
    assert [g[0] for g in got] == [want for _, want in forced]


@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_greedy_mtp_equals_plain_decoding_on_gpu(row_format) -> None:
    plain = asyncio.run(_row_logits(on_gpu(engine_config("baseline"), row_format), JOBS))
    with workdir() as path:
        layout = dataclasses.replace(SPEC_LAYOUT, row_format=row_format)
        svc = start_service(path, layout, device="cuda")
        try:
            real, every = {}, {}
            for mode in MODES:
                flush(svc)  # each run cold: cached prompts would batch the steps differently
                cfg = on_gpu(spec_config(mode, svc, 2), row_format)
                real[mode] = asyncio.run(_row_logits(cfg, JOBS))
                flush(svc)
                cfg = on_gpu(spec_config(mode, svc, 2, (1.0,)), row_format)
                every[mode] = asyncio.run(_run_recorded(cfg, JOBS))
        finally:
            assert svc.stop() == 0, svc.log()
    for mode in MODES:
        _check_equal(plain, real[mode], mode)
        assert every[mode][0] == every["baseline"][0], mode
    tokens, _, totals, picked, _ = every["baseline"]
    assert totals["accepted"] == totals["drafted"] > 0
    _teacher_forced_gpu(row_format, tokens, picked)
