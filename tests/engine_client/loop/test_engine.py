"""The real engine in-process (factory.build_engine), against a real `python -m kv_service`
subprocess over UDS in the service modes: identical tokens and logits in every KV mode, queueing
under admission refusal, cancel, sampling."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from contract import setting_groups
from engine_client.loop.request import Finish, GenRequest, SamplingParams
from engine_client.loop.sampler import sample
from engine_client.serve.factory import build_engine
from kernels.formats import BF16_ROW, FP8_ROW
from tests.process_harness import (
    engine_config,
    flush,
    holds_only_cache,
    layout_with,
    service_stats,
    start_service,
    workdir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """As `serve --cpu-threads 1` does: OpenMP threads spinning against the service
    subprocess (and other tests) make CPU decode steps 10-30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# (prompt, max_new_tokens, sampling): resident, offloaded (prompt + new > 32 hot slots), sampled.
JOBS = [
    (tuple(range(3, 15)), 12, SamplingParams()),
    (tuple((7 * i) % 250 + 1 for i in range(40)), 14, SamplingParams()),
    (tuple(range(100, 120)), 16, SamplingParams(temperature=0.9, seed=7)),
]


MODES = ("baseline", "embedded", "service", "service-remote-swap")


async def _run_jobs(
    cfg, jobs=JOBS, finishes: list | None = None
) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Tokens of every job, and every decode step's logits, through one engine. Every job must
    end by length unless `finishes` is given: it then receives the finish reasons."""
    engine = await build_engine(cfg)
    logits = record_logits(engine)
    reqs = await _drive(engine, jobs)
    if finishes is None:
        assert all(r.finish is Finish.LENGTH for r in reqs), [(r.finish, r.error) for r in reqs]
    else:
        finishes.extend(r.finish for r in reqs)
    return [r.tokens for r in reqs], logits, dict(engine.totals)


def record_logits(engine) -> list[torch.Tensor]:
    """The list every decode step's logits of `engine` will be appended to."""
    logits: list[torch.Tensor] = []
    step = engine.compute.model_runner.step

    def recording_step(*args):
        out = step(*args)
        logits.append(out.clone())
        return out

    engine.compute.model_runner.step = recording_step
    return logits


async def _drive(engine, jobs) -> list[GenRequest]:
    """Submit the jobs to a built engine, start it, follow every stream to its end, stop it."""
    reqs = [engine.api.submit(p, n, s) for p, n, s in jobs]
    engine.start()
    try:
        for req in reqs:
            async for _ in req.follow():
                pass
    finally:
        await engine.stop()
    return reqs


@pytest.mark.parametrize(
    "row_format,row_bytes,overlaps",
    [("bf16", BF16_ROW.row_bytes, (False, True)), ("fp8", FP8_ROW.row_bytes, (True,))],
)
def test_four_modes_give_identical_tokens_and_logits(row_format, row_bytes, overlaps) -> None:
    """Overlap on and off (bf16), and fp8 rows (DeepSeek-V3.2's 656 B rows, quantized by every
    mode's append, the baseline's included) with overlap on: every run equals the baseline
    without overlap. The local modes are told the row format; the service modes adopt it."""
    with workdir() as path:
        svc = start_service(path, layout_with(row_format=row_format))
        try:
            runs = {}
            for mode in MODES:
                for overlap in (False, True) if mode == "baseline" else overlaps:
                    cfg = engine_config(
                        mode,
                        svc if "service" in mode else None,
                        overlap=overlap,
                        row_format=row_format if "service" not in mode else "bf16",
                    )
                    runs[mode, overlap] = asyncio.run(_run_jobs(cfg))
                    stats = service_stats(svc)
                    assert holds_only_cache(stats), stats
                    # Every run starts cold, so every run prefills (and steps) the same way.
                    flush(svc)
            assert service_stats(svc).host_pages.used == 0
        finally:
            assert svc.stop() == 0, svc.log()
        assert svc.segment_files() == []
    base_tokens, base_logits, _ = runs["baseline", False]
    assert [len(t) for t in base_tokens] == [n for _, n, _ in JOBS]
    for (mode, overlap), (tokens, logits, totals) in runs.items():
        assert tokens == base_tokens, (mode, overlap)
        assert len(logits) == len(base_logits), (mode, overlap)
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), (mode, overlap)
        if mode != "baseline":
            # The offloaded request decoded through the host tier.
            assert totals["misses"] > 0 and totals["bytes_moved"] == totals["misses"] * row_bytes, (
                mode
            )
    # Same swap decisions in-stream and remote, with and without overlap.
    swaps = [runs[mode, overlap][2] for mode in MODES[2:] for overlap in overlaps]
    assert all(s == swaps[0] for s in swaps), swaps


def test_stop_tokens_end_requests_identically_with_overlap_on_and_off() -> None:
    """With overlap, a request that stops at step t is already in step t + 1: that row is
    computed and dropped, and its slot is released only after step t + 1. Clients see the same
    tokens either way, and the service ends with nothing held."""
    tokens, _, _ = asyncio.run(_run_jobs(engine_config("baseline"), JOBS))
    greedy_stop, sampled_stop = tokens[1][3], tokens[2][5]
    jobs = JOBS + [
        (JOBS[1][0], 14, SamplingParams(stop_token_ids=(greedy_stop,))),
        (JOBS[2][0], 16, SamplingParams(0.9, 7, stop_token_ids=(sampled_stop,))),
    ]
    with workdir() as path:
        svc = start_service(path)
        try:
            runs = {}
            for mode in MODES:
                for overlap in (False, True):
                    finishes: list = []
                    cfg = engine_config(mode, svc if "service" in mode else None, overlap=overlap)
                    got, logits, _ = asyncio.run(_run_jobs(cfg, jobs, finishes))
                    runs[mode, overlap] = got, finishes, sum(x.shape[0] for x in logits)
            stats = service_stats(svc)
            assert holds_only_cache(stats), stats
        finally:
            assert svc.stop() == 0, svc.log()
    expected = tokens + [
        tokens[1][: tokens[1].index(greedy_stop) + 1],
        tokens[2][: tokens[2].index(sampled_stop) + 1],
    ]
    for key, (got, finishes, _) in runs.items():
        assert got == expected, key
        assert finishes == [Finish.LENGTH] * 3 + [Finish.STOP] * 2, key
    for mode in MODES:  # overlap computed (and dropped) a row after each stop
        assert runs[mode, True][2] == runs[mode, False][2] + 2, mode


def test_refused_admissions_wait_in_the_queue() -> None:
    # Pages for one 20 + 12 token request only (4 pages of 8); three are submitted.
    with workdir() as path:
        svc = start_service(path, layout_with(num_pages=5))
        try:
            cfg = engine_config("service", svc)
            jobs = [(tuple(range(1 + i, 21 + i)), 12, SamplingParams()) for i in range(3)]
            tokens, _, _ = asyncio.run(_run_jobs(cfg, jobs))
            assert [len(t) for t in tokens] == [12, 12, 12]
            stats = service_stats(svc)
            assert stats.rejected_total > 0 and stats.admitted_total == 3
            assert holds_only_cache(stats), stats
        finally:
            assert svc.stop() == 0, svc.log()


async def _cancel_running(cfg) -> tuple[GenRequest, dict]:
    engine = await build_engine(cfg)
    engine.start()
    try:
        req = engine.api.submit(tuple(range(1, 30)), 60, SamplingParams())
        async for ev in req.follow():
            if ev.index == 2:
                engine.api.cancel(req)
                break
        async for _ in req.follow():
            pass
        await asyncio.wait_for(_until_released(engine, req), 10)
        return req, await _stats(engine)
    finally:
        await engine.stop()


async def _until_released(engine, req) -> None:
    while req.request_id in engine.requests:
        engine._wake.set()
        await asyncio.sleep(0)


async def _stats(engine) -> dict:
    s = await engine.control.stats()
    # Pages still used after the release are cached prefix pages nobody uses.
    return {
        "requests": s.requests,
        "pages_held": s.pages_used - s.evictable_pages,
        "slots_used": s.slots_used,
    }


def test_cancel_releases_at_once() -> None:
    with workdir() as path:
        svc = start_service(path)
        try:
            req, stats = asyncio.run(_cancel_running(engine_config("service", svc)))
            assert req.finish is Finish.CANCELLED and len(req.tokens) < 60
            assert stats == {"requests": 0, "pages_held": 0, "slots_used": 0}
        finally:
            assert svc.stop() == 0, svc.log()


def test_embedded_cancel_and_stop_tokens() -> None:
    req, stats = asyncio.run(_cancel_running(engine_config("embedded")))
    assert req.finish is Finish.CANCELLED and stats["requests"] == 0
    tokens, _, _ = asyncio.run(_run_jobs(engine_config("baseline"), JOBS[:1]))
    stop = tokens[0][4]
    first = tokens[0].index(stop)
    stopped, _, _ = asyncio.run(_run_stop(stop))
    assert stopped == tokens[0][: first + 1]


async def _run_stop(stop_token: int):
    engine = await build_engine(engine_config("baseline"))
    engine.start()
    try:
        p, n, _ = JOBS[0]
        req = engine.api.submit(p, n, SamplingParams(stop_token_ids=(stop_token,)))
        async for _ in req.follow():
            pass
        assert req.finish is Finish.STOP
        return req.tokens, None, None
    finally:
        await engine.stop()


def test_sampling_is_a_function_of_seed_and_index() -> None:
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0))
    draws = [sample(logits, 1.0, 3, i) for i in range(20)]
    assert draws == [sample(logits, 1.0, 3, i) for i in range(20)]
    assert draws != [sample(logits, 1.0, 4, i) for i in range(20)]
    assert len(set(draws)) > 5  # a draw, not the argmax
    assert sample(logits, 0.0, 5, 5) == int(torch.argmax(logits))


def test_state_file_round_trip_and_torn_last_line(tmp_path) -> None:
    from engine_client.loop import state_file

    path = str(tmp_path / "state.jsonl")
    f = state_file.StateFile(path)
    done = GenRequest("done", (1, 2), 4, SamplingParams())
    live = GenRequest(
        "live", (3, 4, 5), 8, SamplingParams(temperature=0.5, seed=9, stop_token_ids=(7,))
    )
    with open(path, "w") as old:  # a file of an older engine, world-readable
        old.write("{}\n")
    os.chmod(path, 0o644)
    f.rewrite("sess", 42, [])
    assert os.stat(path).st_mode & 0o777 == 0o600  # it holds prompts
    for r in (done, live):
        f.started(r)
    with open(path) as check:  # start records wait for the step's single write
        assert len(check.readlines()) == 1
    f.tokens({"done": [10], "live": [11]})
    with open(path) as check:
        assert len(check.readlines()) == 4
    f.tokens({"live": [12]})
    f.ended("done")
    f.close()
    with open(path, "a") as torn:
        torn.write('{"tokens": {"live": [1')  # the engine was killed mid-write
    saved = state_file.load(path)
    assert (saved.session_id, saved.epoch, list(saved.requests)) == ("sess", 42, ["live"])
    r = saved.requests["live"]
    assert (r.prompt, r.max_new_tokens, r.sampling, r.tokens) == (
        (3, 4, 5),
        8,
        live.sampling,
        [11, 12],
    )


def test_state_file_queued_records_are_written_at_once(tmp_path) -> None:
    """A queued request is on disk before its id goes out (no step needed); admission turns it
    into a started one, and an end (a queued request cancelled) forgets it."""
    from engine_client.loop import state_file

    path = str(tmp_path / "state.jsonl")
    f = state_file.StateFile(path)
    f.rewrite("sess", 1, [])
    waits, runs, gone = (
        GenRequest(rid, (1, 2), 4, SamplingParams(), cache_salt="t") for rid in "wrg"
    )
    for r in (waits, runs, gone):
        f.queued(r)
    assert state_file.load(path).requests["w"].queued  # no step wrote the file
    f.started(runs)
    f.ended("g")
    f.tokens({"r": [5]})
    saved = state_file.load(path).requests
    assert sorted(saved) == ["r", "w"]
    assert saved["w"].queued and saved["w"].cache_salt == "t"
    assert not saved["r"].queued and saved["r"].tokens == [5]
    f.rewrite("sess", 2, [runs], [waits])  # a restart keeps both
    assert {k: v.queued for k, v in state_file.load(path).requests.items()} == {
        "r": False,
        "w": True,
    }
    f.close()


@pytest.mark.gpu
def test_overlap_on_and_off_identical_on_gpu() -> None:
    """The same jobs, plus stop tokens, on CUDA (graphs, Triton kernels) in the in-process KV
    modes: identical tokens with overlap on and off; identical logits without stop tokens."""

    def cfg(mode: str, overlap: bool):
        return setting_groups.replace(engine_config(mode, overlap=overlap), device="cuda")

    base, base_logits, _ = asyncio.run(_run_jobs(cfg("baseline", False)))
    jobs = JOBS + [(JOBS[1][0], 14, SamplingParams(stop_token_ids=(base[1][3],)))]
    expected = base + [base[1][: base[1].index(base[1][3]) + 1]]
    for mode in ("baseline", "embedded"):
        for overlap in (False, True):
            tokens, logits, _ = asyncio.run(_run_jobs(cfg(mode, overlap)))
            assert tokens == base, (mode, overlap)
            assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), (mode, overlap)
            got, _, _ = asyncio.run(_run_jobs(cfg(mode, overlap), jobs, []))
            assert got == expected, (mode, overlap)
