"""Speculative decoding (--speculative mtp) through the real engine in every KV mode, the KV
service a real subprocess.

Per-row results and GEMM shape: a verify step runs n (D + 1) rows through every matmul where
plain decoding runs n, and a GEMM may round a row differently with another row count (another
kernel or split; cuBLAS does, on CPU MKL may). So the test compares tokens with the
non-speculative run, which holds as long as no step's top two logits are closer than that
rounding (random weights: far apart), and compares logits bit for bit only among the four KV
modes of the speculative run, whose shapes are identical.

The drafts come from the model's MTP layer (nearly all rejected by real acceptance), and are
accepted by the BENCHMARK-ONLY synthetic rule (engine_client/loop/synthetic_acceptance.py): at
rates that accept 0 to 3 drafts per step, so rollback runs at every depth; at rate 1 (every draft
accepted) and rate 0 (none). The synthetic rule emits the accepted drafts and then the target's
token, so each token the target chose must be plain greedy decoding's continuation of the
stream before it: `teacher_forced` checks that with a plain engine prompted with that stream.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from contract import setting_groups
from engine_client.loop.request import SamplingParams
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import MODES, _drive, _run_jobs, one_cpu_thread  # noqa: F401 (autouse)
from tests.process_harness import (
    LOCAL,
    engine_config,
    flush,
    holds_only_cache,
    service_stats,
    start_service,
    workdir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# B - W = 64 = k (D + 1) for top-k 16 and D = 3; W = 8 >= D + 1.
SPEC_LOCAL = dataclasses.replace(LOCAL, hot_slots=72, num_pages=64)
SPEC_LAYOUT = SPEC_LOCAL.layout(num_layers=3, topk=16)  # 2 decoder layers + the MTP layer's
# (prompt, max_new_tokens, sampling): resident, offloaded (64 + 10 > 72), sampled.
JOBS = [
    (tuple(range(3, 15)), 10, SamplingParams()),
    (tuple((7 * i) % 250 + 1 for i in range(64)), 10, SamplingParams()),
    (tuple(range(100, 120)), 8, SamplingParams(temperature=0.9, seed=7)),
]
GREEDY = [i for i, (_, _, s) in enumerate(JOBS) if s.temperature == 0]
MIXED = (0.7, 0.5, 0.5)  # D = 3: steps accept 0, 1, 2 and 3 drafts


def spec_config(
    mode: str,
    svc,
    draft_tokens: int,
    rates: tuple[float, ...] | None = None,
    overlap: bool = False,
):
    """Without overlap unless asked: tests/integration/test_engine_speculative_overlap.py
    compares the two."""
    return setting_groups.replace(
        engine_config(mode, svc if "service" in mode else None),
        local=SPEC_LOCAL,
        speculative="mtp",
        draft_tokens=draft_tokens,
        speculative_acceptance=rates,
        allow_benchmark_only=rates is not None,
        overlap=overlap,
    )


async def _run_recorded(cfg, jobs):
    """As _run_jobs, and per job the indexes of the tokens the target chose (a prefill's
    first token, the token after each step's accepted drafts) and every accepted count."""
    engine = await build_engine(cfg)
    logits: list[torch.Tensor] = []
    step, post = engine.compute.model_runner.step, engine.postprocess
    chosen: dict[str, set[int]] = {}
    accepted: set[int] = set()

    def recording_step(*args):
        logits.append(step(*args).clone())
        return logits[-1]

    def recording_post(out) -> None:
        for chunk, first in zip(out.batch.prefills, out.prefill_tokens):
            if first is not None:
                chosen.setdefault(chunk.req.request_id, set()).add(0)
        for req, a in zip(out.batch.decode, out.accepted):
            chosen.setdefault(req.request_id, set()).add(len(req.tokens) + a)
            accepted.add(a)
        post(out)

    engine.compute.model_runner.step = recording_step
    engine.postprocess = recording_post
    reqs = await _drive(engine, jobs)
    picked = [sorted(i for i in chosen[r.request_id] if i < len(r.tokens)) for r in reqs]
    return [r.tokens for r in reqs], logits, dict(post.totals), picked, accepted


def teacher_forced(jobs, tokens: list[list[int]], picked: list[list[int]]) -> None:
    """Each token the target chose equals plain greedy decoding of the prompt and the
    stream before it (one plain baseline engine, one token per forced stream)."""
    forced = [
        ((jobs[j][0] + tuple(tokens[j][:i]), 1, SamplingParams()), tokens[j][i])
        for j in GREEDY
        for i in picked[j]
    ]
    got, _, _ = asyncio.run(_run_jobs(engine_config("baseline"), [f for f, _ in forced]))
    assert [g[0] for g in got] == [want for _, want in forced]


def test_speculative_tokens_in_every_kv_mode() -> None:
    plain, _, _ = asyncio.run(_run_jobs(engine_config("baseline"), JOBS))
    with workdir() as path:
        svc = start_service(path, SPEC_LAYOUT)

        def cold(mode: str, draft_tokens: int, rates=None, jobs=JOBS):
            got = asyncio.run(_run_recorded(spec_config(mode, svc, draft_tokens, rates), jobs))
            assert holds_only_cache(service_stats(svc))
            # Prefix caching (on by default) keeps the finished requests' pages: flushed, so
            # every run starts cold and prefills (and steps) the same way.
            flush(svc)
            return got

        try:
            first = cold("baseline", 3, MIXED)
            # The offloaded prompt again, stopping at a draft the 2nd step accepted: a step
            # that accepts past a stop token keeps nothing after it.
            stream, picked = first[0][1], first[3][1]
            stop = stream[next(i for i in range(2, len(stream)) if i not in picked)]
            jobs = JOBS + [(JOBS[1][0], JOBS[1][1], SamplingParams(stop_token_ids=(stop,)))]
            mixed = {mode: cold(mode, 3, MIXED, jobs) for mode in MODES}
            every = {mode: cold(mode, 3, (1.0,)) for mode in MODES}
            none = {mode: cold(mode, 2, (0.0,)) for mode in ("embedded", "service-remote-swap")}
            real = {mode: cold(mode, 1) for mode in ("embedded", "service")}
            cached = cached_rerun(svc)
        finally:
            assert svc.stop() == 0, svc.log()
    check_modes_agree(mixed, every_depth=True)
    check_modes_agree(every)
    tokens, _, totals, picked, _ = mixed["baseline"]
    assert tokens[3] == stream[: stream.index(stop) + 1]
    teacher_forced(JOBS, tokens, picked)
    tokens, _, totals, picked, _ = every["baseline"]
    assert totals["accepted"] == totals["drafted"] > 0
    assert all(picked[j] == list(range(0, JOBS[j][1], 4)) for j in GREEDY)
    teacher_forced(JOBS, tokens, picked)
    for mode, (tokens, _, totals, _, _) in (none | real).items():
        assert [tokens[i] for i in GREEDY] == [plain[i] for i in GREEDY], mode
        assert totals["drafted"] > 0, mode
    assert all(run[2]["accepted"] == 0 for run in none.values())
    assert cached[0] == [plain[1]]


def check_modes_agree(runs: dict, every_depth: bool = False) -> None:
    """Tokens (the sampled request's too) and every step's logits equal the baseline's bit for
    bit; HiSparse modes deduplicated misses over the verify rows."""
    base_tokens, base_logits, *_ = runs["baseline"]
    for mode, (tokens, logits, totals, _, accepted) in runs.items():
        assert tokens == base_tokens, mode
        assert len(logits) == len(base_logits)
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
        if every_depth:  # rollback ran at every depth
            assert accepted == {0, 1, 2, 3} and 0 < totals["accepted"] < totals["drafted"]
        if mode != "baseline":
            assert 0 < totals["misses"] < totals["misses_rows"], (mode, totals)


def cached_rerun(svc):
    """Prefix caching: the offloaded prompt again prefills only past its cached pages, which
    hold the MTP layer's KV too; its drafts (verify rows' inputs) and so every step's logits
    equal the cold run's bit for bit. Returns the cold run."""
    cfg = spec_config("service", svc, 1)
    cold_run = asyncio.run(_run_jobs(cfg, JOBS[1:2]))
    hits = service_stats(svc).prefix_hit_tokens_total
    cached_run = asyncio.run(_run_jobs(cfg, JOBS[1:2]))
    assert service_stats(svc).prefix_hit_tokens_total > hits
    assert cold_run[0] == cached_run[0]
    assert len(cold_run[1]) == len(cached_run[1])
    assert all(torch.equal(a, b) for a, b in zip(cold_run[1], cached_run[1]))
    flush(svc)
    assert service_stats(svc).host_pages.used == 0
    return cold_run


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_speculative_on_gpu_in_every_kv_mode(row_format) -> None:
    """CUDA (Triton kernels, CUDA graphs for the verify and draft steps), D = 2: every draft
    accepted (synthetic rate 1), verify logits and tokens equal across the four KV modes; no
    draft accepted (rate 0), greedy tokens equal plain decoding's on CUDA."""

    def on_gpu(cfg):
        local = dataclasses.replace(cfg.local, row_format=row_format)
        return setting_groups.replace(cfg, device="cuda", local=local)

    plain, _, _ = asyncio.run(_run_jobs(on_gpu(engine_config("baseline")), JOBS))
    with workdir() as path:
        layout = dataclasses.replace(SPEC_LAYOUT, row_format=row_format)
        svc = start_service(path, layout, device="cuda")
        try:
            runs, none = {}, {}
            for mode in MODES:
                # Each run from an empty prefix cache: cached prompts would prefill less and
                # batch the steps differently (the H200 run saw it in remote swap).
                flush(svc)
                runs[mode] = asyncio.run(_run_jobs(on_gpu(spec_config(mode, svc, 2, (1.0,))), JOBS))
                flush(svc)
                none[mode] = asyncio.run(_run_jobs(on_gpu(spec_config(mode, svc, 2, (0.0,))), JOBS))
        finally:
            assert svc.stop() == 0, svc.log()
    base_tokens, base_logits, _ = runs["baseline"]
    for mode, (tokens, logits, totals) in runs.items():
        assert tokens == base_tokens, mode
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
        assert totals["accepted"] == totals["drafted"] > 0, (mode, totals)
        assert [none[mode][0][i] for i in GREEDY] == [plain[i] for i in GREEDY], mode
