"""The service's shared hot region (issue 40) returns to empty whenever the session that plans
with it may have changed, and a remote-swap session waiting for it takes it (kv_service/memory/
region_lease.py). Real `python -m kv_service` processes with --shared-slots on CPU; in-process
engines where a detach is enough, engine processes where one is killed (-9).

Each case first fills the region: a cold prompt, then the same prompt again (its 4 full pages
cached), offloaded, so its decode steps read cached rows outside the window ring through the
region. `shared_rows` (GetStats) counts the region's rows that can still hit; the prefix's pages
stay cached throughout (no Flush unless said), so a region that still held them would show."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from engine_client.cli.config import GenerateConfig
from engine_client.loop.request import Finish, SamplingParams
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import one_cpu_thread  # noqa: F401 (autouse fixture)
from tests.process_harness import (
    engine_config,
    flush,
    generated,
    holds_only_cache,
    layout_with,
    service_stats,
    start_engine,
    start_service,
    wait_until,
    workdir,
)
from tests.service_harness import attach

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LAYOUT = layout_with(shared_slots=32)  # one request slot's buffers: 3 request slots left
LEASE = 2.0
PROMPT = tuple((11 * i) % 200 + 3 for i in range(37))  # 4 full pages of 8 are reusable
ENGINE = ("--prefill-chunk", "8")


def _until(svc, predicate, what: str, timeout: float = 10 * LEASE):
    """Poll the service's stats (its lease timer has no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not predicate(stats := service_stats(svc)):
        assert time.monotonic() < deadline, f"{what}: {stats}"
        time.sleep(0.05)
    return stats


def _filled(s) -> bool:
    """Only cached pages held, and rows of them in the region."""
    return holds_only_cache(s) and s.cached_pages > 0 and s.shared_rows > 0


async def _fills(svc) -> None:
    """Wait (the engine's loop runs meanwhile) until the service holds only cached pages and
    rows of them are in the region."""
    await wait_until(lambda: _filled(service_stats(svc)))


async def _run(engine, prompts: list[tuple[int, ...]], n: int = 6) -> list[list[int]]:
    """Each prompt alone, in turn (the first publishes the pages the others reuse)."""
    out = []
    for prompt in prompts:
        req = engine.api.submit(prompt, n, SamplingParams())
        async for _ in req.follow():
            pass
        assert req.finish is Finish.LENGTH, req.error
        out.append(req.tokens)
    return out


def test_flush_and_a_detach_empty_the_region() -> None:
    with workdir() as path:
        svc = start_service(path, layout=LAYOUT)
        try:

            async def main() -> None:
                engine = await build_engine(engine_config("service", svc))
                engine.start()
                try:
                    await _run(engine, [PROMPT, PROMPT])
                    await _fills(svc)
                    flush(svc)  # frees the cached pages: their rows never hit again
                    assert service_stats(svc).shared_rows == 0
                    await _run(engine, [PROMPT, PROMPT])
                    await _fills(svc)
                finally:
                    await engine.stop()  # detaches: the holder's session closes

            asyncio.run(main())
            s = service_stats(svc)
            assert s.sessions == 0 and s.cached_pages > 0 and s.shared_rows == 0, s
        finally:
            assert svc.stop() == 0, svc.log()


def test_a_waiting_remote_swap_session_takes_the_region_when_its_holder_leaves() -> None:
    with workdir() as path:
        svc = start_service(path, layout=LAYOUT)
        try:

            async def main() -> None:
                holder = await build_engine(engine_config("service", svc))  # first: holds it
                waiting = await build_engine(engine_config("service-remote-swap", svc))
                waiting.start()
                try:
                    before = await _run(waiting, [PROMPT, PROMPT])
                    await wait_until(lambda: holds_only_cache(service_stats(svc)))
                    assert service_stats(svc).shared_rows == 0  # planned privately
                    await holder.stop()
                    after = await _run(waiting, [PROMPT])  # its next step takes the region
                    assert after == before[1:]
                    await _fills(svc)  # the waiting session planned with the region
                    # Its engine re-attaching (a restart, or a stream drop's retry): the
                    # service, which plans for it, starts the region over.
                    c = waiting.control
                    fingerprint = c.model_fingerprint
                    attach(
                        svc,
                        resume_session_id=c.session_id,
                        remote_swap=True,
                        model_fingerprint=fingerprint,
                    )
                    assert service_stats(svc).shared_rows == 0
                finally:
                    await waiting.stop()
                    await holder.stop()

            asyncio.run(main())
            assert service_stats(svc).shared_rows == 0
        finally:
            assert svc.stop() == 0, svc.log()


def job(n: int = 6) -> GenerateConfig:
    return GenerateConfig(target="", prompt=PROMPT, max_new_tokens=n, timeout=60)


def test_a_killed_engine_leaves_an_empty_region_when_its_lease_expires() -> None:
    with workdir() as path:
        svc = start_service(path, layout=LAYOUT, lease=LEASE)
        eng = start_engine(path, "service", svc, extra=ENGINE)
        try:
            asyncio.run(generated(eng, job()))
            asyncio.run(generated(eng, job()))
            _until(svc, _filled, "region not filled")
            eng.signal(9)  # no detach: the session lives on until its lease expires
            eng.proc.wait(10)
            assert service_stats(svc).shared_rows > 0
            s = _until(svc, lambda s: s.expired_sessions_total == 1, "lease never expired")
            assert s.sessions == 0 and s.cached_pages > 0 and s.shared_rows == 0, s
        finally:
            eng.kill()
            assert svc.stop() == 0, svc.log()


def test_a_restarted_engine_resumes_its_session_with_an_empty_region() -> None:
    """Killed (-9) between requests and restarted on its state file within the lease: the
    same session, still holding the region, which its engine plans with in-stream and starts
    empty (engine_client/serve/restore.py), then fills again. (A remote-swap session's
    re-attach: the test above.)"""
    kv_mode = "service"
    with workdir() as path:
        svc = start_service(path, layout=LAYOUT)
        extra = ("--state-file", os.path.join(path, "engine.state"), *ENGINE)
        eng = start_engine(path, kv_mode, svc, extra=extra)
        try:
            cold = asyncio.run(generated(eng, job()))
            assert asyncio.run(generated(eng, job())) == cold
            _until(svc, _filled, "region not filled")
            eng.signal(9)
            eng.proc.wait(10)
            eng = start_engine(path, kv_mode, svc, "engine2", extra)
            s = service_stats(svc)
            assert s.sessions == 1 and s.expired_sessions_total == 0, s  # resumed, not new
            assert s.cached_pages > 0 and s.shared_rows == 0, s
            assert asyncio.run(generated(eng, job())) == cold
            _until(svc, _filled, "region not filled after the restart")
        finally:
            assert eng.stop() == 0, eng.log()
            assert svc.stop() == 0, svc.log()
