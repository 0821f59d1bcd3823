"""Overlapped speculative steps (issue 41 item 3): with --overlap 1 the engine launches verify
step t + 1 before step t's tokens reach the host. The host then knows neither the step's
positions nor its sampled rows' keys; they come from the device (SpeculativeModelRunner.next_pos,
moved on by the accepted count in the draft graph; speculative.row_keys). These tests run the
same requests overlapped and not, in every KV mode, and compare the tokens bit for bit (greedy
and sampled), with stop tokens and max_new_tokens found one step late (the step in flight is
computed and dropped), admissions into slots freed while a step was in flight, a cancel, and
the BENCHMARK-ONLY synthetic acceptance at rates that accept 0..3 drafts (rollback at every
depth) and every draft (the reservation's worst case).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract import setting_groups
from engine_client.loop.request import Finish, SamplingParams
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import (  # noqa: F401 (one_cpu_thread: autouse)
    MODES,
    _cancel_running,
    _drive,
    _run_jobs,
    one_cpu_thread,
)
from tests.integration.test_engine_speculative import (
    GREEDY,
    JOBS,
    MIXED,
    SPEC_LAYOUT,
    check_modes_agree,
    spec_config,
)
from tests.process_harness import (
    engine_config,
    flush,
    holds_only_cache,
    service_stats,
    start_service,
    workdir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Beyond JOBS (and a stop-token job): two requests that wait for a slot (4 slots), admitted
# into slots freed while a step was in flight, one of them sampled.
LATER = [
    (tuple(range(40, 52)), 7, SamplingParams()),
    (tuple(range(200, 216)), 11, SamplingParams(temperature=0.8, seed=3)),
]
# Every draft accepted (D = 3: 4 tokens a step): at 7 and 11 new tokens the step in flight
# ends D - 1 tokens past max_new_tokens when the next one is launched, the worst case the
# admission's reservation covers (engine_client.loop.speculative.reserve_extra).
TIGHT = [(tuple(range(3, 15)), 11, SamplingParams()), (tuple(range(60, 70)), 7, SamplingParams())]


async def _recorded(cfg, jobs) -> tuple:
    """(tokens, logits, totals, finishes, accepted counts, staged positions, spare): spare is
    the fewest reserved positions any step left unused past the last one its rows wrote."""
    engine = await build_engine(cfg)
    D, extra = cfg.speculation.draft_tokens, engine.scheduler.reserve_extra
    step, post = engine.compute.model_runner.step, engine.postprocess
    logits: list[torch.Tensor] = []
    staged: list[int] = []
    accepted: set[int] = set()
    spare = [extra]

    def recording_step(ids, positions, *rest):
        staged.extend(positions)
        logits.append(step(ids, positions, *rest).clone())
        return logits[-1]

    def recording_post(out) -> None:
        for req, p, a in zip(out.batch.decode, out.positions, out.accepted):
            # The verify rows write up to p + D, the MTP layer's drafting rows p + a + D - 1.
            last = req.prompt_len + req.max_new_tokens + extra - 1
            spare[0] = min(spare[0], last - (p + max(D, a + D - 1)))
            accepted.add(a)
        post(out)

    engine.compute.model_runner.step = recording_step
    engine.postprocess = recording_post
    reqs = await _drive(engine, jobs)
    tokens, finishes = [r.tokens for r in reqs], [r.finish for r in reqs]
    return tokens, logits, dict(post.totals), finishes, accepted, staged, spare[0]


def test_overlapped_speculative_steps_equal_waiting_ones() -> None:
    plain, _, _ = asyncio.run(_run_jobs(engine_config("baseline"), JOBS))
    with workdir() as path:
        svc = start_service(path, SPEC_LAYOUT)

        def run(mode: str, overlap: bool, rates, jobs, draft_tokens: int = 3):
            cfg = spec_config(mode, svc, draft_tokens, rates, overlap=overlap)
            got = asyncio.run(_recorded(cfg, jobs))
            assert holds_only_cache(service_stats(svc)), (mode, overlap)
            flush(svc)  # every run starts cold, so every run prefills the same way
            return got

        try:
            stream = run("baseline", False, MIXED, JOBS)[0][1]
            stop = stream[5]
            jobs = JOBS + [(JOBS[1][0], JOBS[1][1], SamplingParams(stop_token_ids=(stop,)))]
            jobs += LATER
            runs = {(m, o): run(m, o, MIXED, jobs) for m in MODES for o in (False, True)}
            tight = {o: run("service", o, (1.0,), TIGHT) for o in (False, True)}
            real = run("embedded", True, None, JOBS, draft_tokens=1)
            cancel = _cancel_running(spec_config("service", svc, 3, MIXED, overlap=True))
            cancelled, stats = asyncio.run(cancel)
        finally:
            assert svc.stop() == 0, svc.log()
    finishes = [Finish.LENGTH] * 3 + [Finish.STOP] + [Finish.LENGTH] * 2
    for mode in MODES:
        waited, overlapped = runs[mode, False], runs[mode, True]
        assert overlapped[0] == waited[0], mode  # every request's tokens, the sampled ones too
        assert overlapped[3] == waited[3] == finishes, mode
        assert -1 not in waited[5] and -1 in overlapped[5], mode  # positions from the device
        assert min(waited[6], overlapped[6]) >= 0, mode
    assert runs["baseline", True][0][3] == stream[: stream.index(stop) + 1]
    check_modes_agree({m: runs[m, True][:5] for m in MODES}, every_depth=True)
    assert tight[True][0] == tight[False][0]
    assert tight[True][6] == 0 <= tight[False][6]  # the reservation is needed, and enough
    assert [real[0][i] for i in GREEDY] == [plain[i] for i in GREEDY]
    assert real[2]["drafted"] > 0 and -1 in real[5]
    assert cancelled.finish is Finish.CANCELLED and len(cancelled.tokens) < 60
    assert stats == {"requests": 0, "pages_held": 0, "slots_used": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_overlapped_speculative_steps_on_gpu(row_format) -> None:
    """CUDA: the verify and draft steps graph-captured (remote swap: eager), HiSparse's
    micro-batches on their side stream, overlap on. D = 2 at rates accepting 0..2 drafts,
    with a stop token, late admissions and a sampled request: every mode's tokens equal its
    run without overlap, and the overlapped runs' logits equal across modes bit for bit.
    (Overlap vs not compares tokens only: a finished request's row computed in the step in
    flight changes the batch, and a GPU GEMM may round another batch's rows differently.)"""
    import dataclasses

    def on_gpu(cfg):
        local = dataclasses.replace(cfg.local, row_format=row_format)
        return setting_groups.replace(cfg, device="cuda", local=local)

    with workdir() as path:
        layout = dataclasses.replace(SPEC_LAYOUT, row_format=row_format)
        svc = start_service(path, layout, device="cuda")

        def run(mode: str, overlap: bool, jobs):
            cfg = on_gpu(spec_config(mode, svc, 2, (0.7, 0.5), overlap=overlap))
            got = asyncio.run(_recorded(cfg, jobs))
            assert holds_only_cache(service_stats(svc)), (mode, overlap)
            flush(svc)
            return got

        try:
            stream = run("baseline", False, JOBS)[0][1]
            stop = SamplingParams(stop_token_ids=(stream[5],))
            jobs = JOBS + [(JOBS[1][0], JOBS[1][1], stop)] + LATER
            runs = {(m, o): run(m, o, jobs) for m in MODES for o in (False, True)}
        finally:
            assert svc.stop() == 0, svc.log()
    for mode in MODES:
        waited, overlapped = runs[mode, False], runs[mode, True]
        assert overlapped[0] == waited[0], mode
        assert overlapped[3] == waited[3], mode
        assert -1 in overlapped[5] and min(waited[6], overlapped[6]) >= 0, mode
    check_modes_agree({m: runs[m, True][:5] for m in MODES})
