"""Speculative decoding (--speculative mtp) through the real engine in every KV mode, the KV
service a real subprocess: greedy tokens equal those of decoding without speculation.

Per-row results and GEMM shape: a verify step runs n (D + 1) rows through every matmul where
plain decoding runs n, and a GEMM may round a row differently with another row count (another
kernel or split; cuBLAS does, on CPU MKL may). So the test compares tokens with the
non-speculative run, which holds as long as no step's top two logits are closer than that
rounding (random weights: far apart), and compares logits bit for bit only among the four KV
modes of the speculative run, whose shapes are identical.

The drafts come from the model's MTP layer (D = 1: nearly all rejected), and from the
BENCHMARK-ONLY replay of the recorded greedy run (bench/mtp/draft_replay.py) with every 5th
position made wrong (D = 3): steps that accept 0 to 3 drafts, so rollback runs at every depth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import pytest
import torch

from bench.mtp.draft_replay import write_recording
from engine_client.loop.request import SamplingParams
from tests.engine_client.loop.test_engine import MODES, _run_jobs, one_cpu_thread  # noqa: F401 (autouse)
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


def spec_config(mode: str, svc, draft_tokens: int, source: str = "mtp"):
    return dataclasses.replace(
        engine_config(mode, svc if "service" in mode else None),
        local=SPEC_LOCAL,
        speculative="mtp",
        draft_tokens=draft_tokens,
        draft_source=source,
        overlap=False,
    )


def with_stop(plain: list[list[int]]) -> tuple[list, list[list[int]]]:
    """JOBS plus the offloaded prompt again, stopping at its 5th token: a verify step that
    accepts past a stop token keeps nothing after it."""
    stop = plain[1][4]
    jobs = JOBS + [(JOBS[1][0], JOBS[1][1], SamplingParams(stop_token_ids=(stop,)))]
    return jobs, plain + [plain[1][: plain[1].index(stop) + 1]]


def test_speculative_tokens_equal_plain_decoding_in_every_kv_mode() -> None:
    plain, _, _ = asyncio.run(_run_jobs(engine_config("baseline"), JOBS))
    greedy = [i for i, (_, _, s) in enumerate(JOBS) if s.temperature == 0]
    jobs, expected = with_stop(plain)
    with workdir() as path:
        recording = os.path.join(path, "greedy.jsonl")
        write_recording(recording, [(JOBS[i][0], plain[i]) for i in greedy])
        replay = "bench.mtp.draft_replay:replay_source:" + json.dumps(
            {"path": recording, "wrong_every": 5}
        )
        svc = start_service(path, SPEC_LAYOUT)

        def cold(mode: str, draft_tokens: int, source: str = "mtp", *args):
            cfg = spec_config(mode, svc, draft_tokens, source)
            got = asyncio.run(_run_jobs(cfg, *args))
            stats = service_stats(svc)
            assert holds_only_cache(stats), stats
            # Prefix caching (on by default) keeps the finished requests' pages: flushed, so
            # every run starts cold and prefills (and steps) the same way.
            flush(svc)
            return got

        try:
            runs = {mode: cold(mode, 3, replay, jobs, []) for mode in MODES}
            mtp = {mode: cold(mode, 1, "mtp", JOBS) for mode in ("embedded", "service")}
            # Prefix caching: the offloaded prompt again prefills only past its cached pages,
            # which hold the MTP layer's KV too; its drafts (verify rows' inputs) and so every
            # step's logits equal the cold run's bit for bit.
            cfg = spec_config("service", svc, 1)
            cold_run = asyncio.run(_run_jobs(cfg, JOBS[1:2]))
            hits = service_stats(svc).prefix_hit_tokens_total
            cached_run = asyncio.run(_run_jobs(cfg, JOBS[1:2]))
            assert service_stats(svc).prefix_hit_tokens_total > hits
            assert cold_run[0] == cached_run[0] == [plain[1]]
            assert len(cold_run[1]) == len(cached_run[1])
            assert all(torch.equal(a, b) for a, b in zip(cold_run[1], cached_run[1]))
            flush(svc)
            assert service_stats(svc).host_pages.used == 0
        finally:
            assert svc.stop() == 0, svc.log()
    base_tokens, base_logits, _ = runs["baseline"]
    for mode, (tokens, logits, totals) in runs.items():
        assert [tokens[i] for i in greedy + [3]] == [expected[i] for i in greedy + [3]], mode
        assert tokens == base_tokens, mode  # the sampled request too, across KV modes
        assert len(logits) == len(base_logits)
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
        # Drafts were accepted and rejected: every depth of rollback ran.
        assert 0 < totals["accepted"] < totals["drafted"], (mode, totals)
        if mode != "baseline":
            assert 0 < totals["misses"] < totals["misses_rows"], (mode, totals)
    for mode, (tokens, _, totals) in mtp.items():
        assert [tokens[i] for i in greedy] == [plain[i] for i in greedy], mode
        assert totals["drafted"] > 0, mode


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_speculative_on_gpu_in_every_kv_mode(row_format) -> None:
    """CUDA (Triton kernels, CUDA graphs for the verify and draft steps), D = 2 with the
    replayed drafts accepted 100%: greedy tokens equal plain decoding's (plain decoding on
    CUDA too), verify logits equal across the four KV modes."""

    def on_gpu(cfg):
        local = dataclasses.replace(cfg.local, row_format=row_format)
        return dataclasses.replace(cfg, device="cuda", local=local)

    plain, _, _ = asyncio.run(_run_jobs(on_gpu(engine_config("baseline")), JOBS))
    greedy = [i for i, (_, _, s) in enumerate(JOBS) if s.temperature == 0]
    with workdir() as path:
        recording = os.path.join(path, "greedy.jsonl")
        write_recording(recording, [(JOBS[i][0], plain[i]) for i in greedy])
        replay = "bench.mtp.draft_replay:replay_source:" + json.dumps({"path": recording})
        layout = dataclasses.replace(SPEC_LAYOUT, row_format=row_format)
        svc = start_service(path, layout, device="cuda")
        try:
            runs = {}
            for mode in MODES:
                # Each run from an empty prefix cache: cached prompts would prefill less and
                # batch the steps differently (the H200 run saw it in remote swap).
                flush(svc)
                runs[mode] = asyncio.run(_run_jobs(on_gpu(spec_config(mode, svc, 2, replay)), JOBS))
        finally:
            assert svc.stop() == 0, svc.log()
    _, base_logits, _ = runs["baseline"]
    for mode, (tokens, logits, totals) in runs.items():
        assert [tokens[i] for i in greedy] == [plain[i] for i in greedy], mode
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
        assert totals["accepted"] == totals["drafted"] > 0, (mode, totals)
