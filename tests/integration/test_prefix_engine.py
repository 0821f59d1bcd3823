"""Prefix sharing through the real engine (factory.build_engine), in every KV mode (the service
modes against a `python -m kv_service` subprocess): requests that reuse a cached prefix give
bitwise the tokens and logits of the same requests without sharing, and nothing on the data
path writes a shared page (every append is checked against the shared pages, and the shared
pages' bytes are compared before and after)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import pytest
import torch

from contract import setting_groups
from engine_client.kv.baseline import BaselineBackend
from engine_client.loop.request import Finish, SamplingParams
from engine_client.loop.synthetic import SyntheticContext
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import one_cpu_thread  # noqa: F401 (autouse fixture)
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

P = LOCAL.page_size  # 8; the engine's prefill chunk is 8 too
SHARED = tuple((7 * i) % 250 + 1 for i in range(24))
# (prompt, max_new_tokens, salt, cached tokens expected): offloaded (27 + 6 > 32 hot slots),
# resident with a cached prefix (copied into its hot slots), offloaded with cached rows in its
# window ring, and the same prompt under another salt (never shared).
JOBS = [
    (SHARED + (3, 4, 5), 6, "", 0),
    (SHARED + (9, 9, 8), 5, "", 24),
    (SHARED[:17] + (1,), 15, "", 16),
    (SHARED + (9, 9, 8), 5, "tenant-b", 0),
]
MODES = ("baseline", "embedded", "service", "service-remote-swap")


@pytest.fixture(scope="module")
def svc():
    """One service for the module; every test leaves it holding nothing (flushed)."""
    with workdir() as path:
        service = start_service(path)
        try:
            yield service
        finally:
            assert service.stop() == 0, service.log()
        assert service.segment_files() == []


class SharedPageGuard:
    """Wraps a backend's append: every row it writes must land outside the pages that an
    admission mapped as a cached prefix. Also fingerprints those pages' bytes (KV rows and
    index keys, every layer) when first seen, to compare at the end."""

    def __init__(self, backend, page_table: torch.Tensor, watch: bool = True) -> None:
        """watch: check every append (not inside CUDA graphs: it reads its rows on the host)."""
        self.backend, self.page_table = backend, page_table
        self.shared: dict[int, str] = {}
        self.violations: list[tuple[int, int, int]] = []
        self._append = backend.append
        if watch:
            backend.append = self.append

    def admitted(self, pages: tuple[int, ...], cached: int) -> None:
        for page in pages[: cached // P]:
            self.shared.setdefault(page, self.digest(page))

    def append(self, layer, kv_rows, index_rows, req_slots, positions, seq_lens) -> None:
        for r, t, n in zip(req_slots.tolist(), positions.tolist(), seq_lens.tolist()):
            page = int(self.page_table[r, t // P]) if r >= 0 and 0 <= t < n else -1
            if page in self.shared:
                self.violations.append((r, t, page))
        self._append(layer, kv_rows, index_rows, req_slots, positions, seq_lens)

    def digest(self, page: int) -> str:
        be = self.backend
        if isinstance(be, BaselineBackend):
            rows, keys = be._kv[:, page * P : (page + 1) * P], be._pool[:, page]
        else:
            rows, keys = be.kv.host_kv[page], be.kv.index_pool[:, page]
        h = hashlib.sha256(rows.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest() + hashlib.sha256(keys.contiguous().cpu().numpy().tobytes()).hexdigest()


async def _run(
    cfg, jobs, watch: bool = True
) -> tuple[list, list[torch.Tensor], list[int], SharedPageGuard, dict]:
    """Each job alone (one after the other, so every step has one row in both runs): tokens,
    every decode step's logits, cached tokens, the guard and the KV side's stats."""
    engine = await build_engine(cfg)
    be = engine.compute.backend
    guard = SharedPageGuard(be, be.page_table, watch)
    logits: list[torch.Tensor] = []
    step, admit = engine.compute.model_runner.step, engine.control.admit

    def recording_step(*args):
        out = step(*args)
        logits.append(out.clone())
        return out

    async def watched_admit(*args):
        adm = await admit(*args)
        guard.admitted(adm.pages, adm.cached_tokens)
        return adm

    engine.compute.model_runner.step = recording_step
    engine.control.admit = watched_admit
    engine.start()
    tokens, cached = [], []
    try:
        for prompt, n, salt, _ in jobs:
            req = engine.api.submit(prompt, n, SamplingParams(), cache_salt=salt)
            async for _ in req.follow():
                pass
            assert req.finish is Finish.LENGTH, req.error
            tokens.append(req.tokens)
            cached.append(req.cached_tokens)
        await engine.reports.flush()
        while engine.requests:  # the last release follows its last step
            engine._wake.set()
            await asyncio.sleep(0)
        stats = await engine.control.stats()
        changed = [p for p, d in guard.shared.items() if guard.digest(p) != d]
    finally:
        await engine.stop()
    assert not changed, f"shared pages {changed} changed"
    return tokens, logits, cached, guard, dataclasses.asdict(stats)


def _turn2(first_prompt: tuple[int, ...], answer: list[int], generated: bool = True) -> tuple:
    """The next turn of a conversation: its prompt, the answer, a new message. The answer's
    full pages were published when the first turn ended (if `generated` pages are shared)."""
    prompt = first_prompt + tuple(answer) + (5, 6)
    shared = len(prompt) - 1 if generated else len(first_prompt)
    return (prompt, 4, "", shared // P * P)


def _every_mode(svc, cfg, generated: bool = True, watch: bool = True) -> None:
    """Every mode with prefix caching (cfg(mode, **changes)) against the baseline without:
    the same tokens and logits, the expected cached tokens, no shared page written."""
    # Without sharing, each job alone: the next turn runs in an engine of its own.
    cold, cold_logits, cold_cached, _, _ = asyncio.run(
        _run(cfg("baseline", prefix_cache=False), JOBS)
    )
    jobs = JOBS + [_turn2(JOBS[0][0], cold[0], generated)]
    more, more_logits, more_cached, _, _ = asyncio.run(
        _run(cfg("baseline", prefix_cache=False), jobs[-1:])
    )
    cold, cold_logits = cold + more, cold_logits + more_logits
    assert cold_cached + more_cached == [0] * len(jobs)
    hits = service_stats(svc).prefix_hit_tokens_total
    for mode in MODES:
        tokens, logits, cached, guard, stats = asyncio.run(_run(cfg(mode), jobs, watch))
        assert cached == [j[3] for j in jobs], mode
        assert tokens == cold, mode
        assert len(logits) == len(cold_logits), mode
        assert all(torch.equal(a, b) for a, b in zip(logits, cold_logits)), mode
        assert guard.shared and not guard.violations, (mode, guard.violations)
        # Nothing is held; shared pages counted once; no page in use was evicted.
        assert stats["requests"] == 0 and stats["pages_used"] == stats["evictable_pages"]
        if "service" in mode:
            s = service_stats(svc)
            assert holds_only_cache(s) and s.evicted_pages_total == 0, s
            hits += sum(j[3] for j in jobs)
            assert s.prefix_hit_tokens_total == hits, s
            assert flush(svc).pages_freed == s.cached_pages
    assert service_stats(svc).host_pages.used == 0


def test_every_mode_reuses_prefixes_and_equals_the_cold_run(svc) -> None:
    """On CPU a decode step writes the same rows as a prefill, so the next turn of a
    conversation, which reuses the answer's pages, is bitwise a cold prefill too."""
    _every_mode(
        svc, lambda mode, **kw: engine_config(mode, svc if "service" in mode else None, **kw)
    )


def test_page_granular_reuse_equals_the_cold_run_on_cpu(svc) -> None:
    """--prefix-reuse-pages with a prefill chunk of two pages: prefixes are reused to the page
    (JOBS' cached counts, multiples of 8, not of 16), the next prefill starts mid-chunk, and
    on CPU every mode still gives the cold run's tokens and logits bitwise."""

    def cfg(mode: str, **kw):
        svc_or_none = svc if "service" in mode else None
        kw = {"prefill_chunk": 2 * P, "prefix_reuse_pages": True, **kw}
        return engine_config(mode, svc_or_none, **kw)

    assert any(j[3] % (2 * P) for j in JOBS)  # some reuse is not a multiple of the chunk
    _every_mode(svc, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("reuse_pages", [False, True], ids=["chunk", "pages-batch-invariant"])
def test_every_mode_reuses_prompt_prefixes_bitwise_on_gpu(reuse_pages: bool) -> None:
    """The same on CUDA, with CUDA graphs (the append guard cannot look inside them: the
    shared pages' bytes are compared). Only prompt pages are shared: a decode step's rows
    (batched GEMMs, split attention) need not equal a prefill's bit for bit on a GPU. With
    reuse_pages (a chunk of two pages), a prefill starts mid-chunk: bitwise only where its rows
    do not depend on the chunk, so the model runs batch-invariant (both runs alike)."""
    more = {"prefill_chunk": 2 * P, "prefix_reuse_pages": True} if reuse_pages else {}
    with workdir() as path:
        svc = start_service(path, device="cuda")
        try:

            def cfg(mode: str, **kw):
                c = engine_config(
                    mode,
                    svc if "service" in mode else None,
                    prefix_share_generated=False,
                    **{**more, **kw},
                )
                if reuse_pages:
                    c = setting_groups.replace(c, batch_invariant=True)
                return setting_groups.replace(c, device="cuda")

            _every_mode(svc, cfg, generated=False, watch=False)
        finally:
            assert svc.stop() == 0, svc.log()


def test_the_guard_sees_a_write_into_a_shared_page() -> None:
    """The check above can fail: an append at a cached position is reported."""
    cfg = engine_config("embedded")

    async def run() -> SharedPageGuard:
        engine = await build_engine(cfg)
        try:
            be = engine.compute.backend
            guard = SharedPageGuard(be, be.page_table)
            be.kv.page_table[2, :2] = torch.tensor([5, 6], dtype=torch.int32)
            guard.admitted((5, 6), 16)
            rows = torch.zeros((1, 576), dtype=torch.bfloat16)
            keys = torch.zeros((1, 256), dtype=torch.uint8)
            one = torch.ones(1, dtype=torch.int32)
            guard.append(0, rows, keys, 2 * one, 9 * one, 12 * one)  # position 9: page 6
            guard.append(0, rows, keys, 2 * one, 16 * one, 17 * one)  # position 16: private
            return guard
        finally:
            await engine.stop()

    guard = asyncio.run(run())
    assert guard.violations == [(2, 9, 6)]


async def _interrupted(cfg, prompt: tuple[int, ...], n: int, after: int) -> str:
    """Run a request until `after` tokens, then stop the engine leaving it with the service."""
    engine = await build_engine(cfg)
    engine.start()
    req = engine.api.submit(prompt, n, SamplingParams())
    try:
        async for ev in req.follow():
            if ev.index + 1 >= after:
                break
        return req.request_id
    finally:
        await engine.stop(keep_requests=True)


async def _resumed(cfg, request_id: str):
    engine = await build_engine(cfg)
    engine.start()
    try:
        req = engine.api.lookup(request_id)
        async for _ in req.follow():
            pass
        return req
    finally:
        await engine.stop()


def test_a_resumed_session_keeps_its_shared_pages(svc, tmp_path) -> None:
    """An engine restarts (its state file names the session) while a request holds a cached
    prefix: the new engine resumes it on the same shared pages, never prefills them again, and
    ends with the tokens of an uninterrupted run; only cached pages are left."""
    prompt = SHARED + (3, 4, 5)
    before = service_stats(svc).prefix_hit_tokens_total
    cfg = engine_config("service", svc, state_file=str(tmp_path / "engine.state"))
    cold, _, _, _, _ = asyncio.run(_run(cfg, [(prompt, 10, "", 0)]))
    rid = asyncio.run(_interrupted(cfg, prompt, 10, after=3))
    held = service_stats(svc)
    assert held.requests == 1 and held.evictable_pages < held.cached_pages, held
    req = asyncio.run(_resumed(cfg, rid))
    assert req.tokens == cold[0] and req.cached_tokens == 24
    stats = service_stats(svc)
    assert holds_only_cache(stats) and stats.prefix_hit_tokens_total == before + 24, stats
    flush(svc)


def test_a_synthetic_context_shares_only_its_shared_part() -> None:
    """Benchmarks (--synthetic-shared): the shared part has the same names and rows for every
    request, the rest is named (and seeded) by a per-request serial."""
    sc = SyntheticContext(12, 8)
    a, b = sc.placeholders(1, 256), sc.placeholders(2, 256)
    assert len(a) == 12 and a[:8] == b[:8] == (0,) * 8 and a[8] != b[8]
    assert sc.regions(0, a) == ((0, 8, 0), (8, 12, a[8]))
    assert sc.regions(8, a) == ((8, 12, a[8]),)  # the shared part came from the cache
    with pytest.raises(RuntimeError):
        sc.regions(4, a)  # a shared part is reused whole or not at all
    own = SyntheticContext(12, 0).placeholders(3, 256)
    assert SyntheticContext(12, 0).regions(0, own) == ((0, 12, own[0]),)
