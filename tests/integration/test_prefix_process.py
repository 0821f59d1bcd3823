"""Prefix sharing through real processes (service, engine, clients over UDS, CPU): a request
reusing a cached prefix streams the tokens of a cold one; shared pages are never leaked, whether
a client cancels or the engine holding them is killed (-9) and its lease expires; a flush then
empties the pools. (An engine that resumes its session keeps its references:
tests/integration/test_prefix_engine.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream
from tests.process_harness import (
    engine_channel,
    flush,
    holds_only_cache,
    service_stats,
    start_engine,
    start_service,
    workdir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LEASE = 2.0
PROMPT = tuple((11 * i) % 200 + 3 for i in range(37))  # 4 full pages of 8 are reusable
ENGINE = ("--prefill-chunk", "8")


def job(prompt: tuple[int, ...] = PROMPT, n: int = 12) -> GenerateConfig:
    return GenerateConfig(target="", prompt=prompt, max_new_tokens=n, timeout=60)


async def _stream(eng, cfg: GenerateConfig, stop_after: int = 0, kill=None, skip: int = 0):
    """Stream; after `stop_after` tokens, SIGKILL the engine `kill` or (None) go away."""
    result = GenerationResult()
    async with engine_channel(eng) as channel:
        async for _ in generate_stream(channel, cfg, result, skip):
            if stop_after and len(result.tokens) >= stop_after:
                if kill is not None:
                    kill.signal(9)
                break
    return result


def _until(svc, predicate, what: str, timeout: float = 10 * LEASE):
    """Poll the service's stats (its lease timer has no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not predicate(stats := service_stats(svc)):
        assert time.monotonic() < deadline, f"{what}: {stats}"
        time.sleep(LEASE / 8)
    return stats


def test_cached_prefix_streams_cold_tokens_and_no_page_leaks_on_cancel_or_kill() -> None:
    with workdir() as path:
        svc = start_service(path, lease=LEASE)
        eng = start_engine(path, "service", svc, extra=ENGINE)
        try:
            cold = asyncio.run(_stream(eng, job()))
            cached = asyncio.run(_stream(eng, job()))
            assert (cold.cached_tokens, cached.cached_tokens) == (0, 32)
            assert cached.tokens == cold.tokens and len(cold.tokens) == 12
            # The engine releases a finished request after its stream ends: wait for it.
            _until(svc, holds_only_cache, "finished request not released")
            # A client that goes away frees its request; the shared pages stay cached.
            gone = asyncio.run(_stream(eng, job(PROMPT + (1, 2), 60), stop_after=2))
            assert len(gone.tokens) == 2
            _until(svc, holds_only_cache, "cancelled request not released")
            # An engine killed while holding shared pages: its lease expires, refs go back.
            asyncio.run(_stream(eng, job(PROMPT + (4,), 60), stop_after=2, kill=eng))
            eng.proc.wait(10)
            held = service_stats(svc)
            assert held.requests == 1 and held.evictable_pages < held.cached_pages, held
            stats = _until(svc, holds_only_cache, "lease never expired")
            assert stats.expired_sessions_total == 1 and stats.cached_pages > 0
            assert stats.prefix_hit_tokens_total == 3 * 32
            assert flush(svc).pages_freed == stats.cached_pages
            assert service_stats(svc).host_pages.used == 0
        finally:
            eng.kill()
            assert svc.stop() == 0, svc.log()
        assert svc.segment_files() == []
