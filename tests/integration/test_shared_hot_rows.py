"""Shared hot rows (issue 40, item 1) through the real engine on CPU with the reference plan, in
every KV mode that has hot buffers (embedded: the engine's own region; service and
service-remote-swap: the service's, started with --shared-slots): requests that read a cached
prefix through the shared hot region give bitwise the tokens and logits of the same requests
without prefix sharing, alone or decoding together (three requests on one cached prefix, each
step's batch the same with the region on or off). The service's region holds no row that can
hit once Flush freed its pages. Tenants (cache salts) never share a prefix page, so never a
region row, while a tenant's requests share both."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from contract import setting_groups
from engine_client.loop.request import Finish, SamplingParams
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import (  # noqa: F401 (autouse fixture)
    one_cpu_thread,
    record_logits,
)
from tests.integration.test_prefix_engine import JOBS, SHARED, P, _every_mode, _run, _turn2
from tests.process_harness import (
    engine_config,
    flush,
    layout_with,
    service_stats,
    start_service,
    workdir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REGION = 32  # one request slot's buffers (hot_slots 32): 3 request slots are left


@pytest.fixture(scope="module")
def svc():
    """A service whose layout has the region; every test leaves it holding nothing."""
    with workdir() as path:
        service = start_service(path, layout=layout_with(shared_slots=REGION))
        try:
            yield service
        finally:
            assert service.stop() == 0, service.log()
        assert service.segment_files() == []


def cfg(shared_slots: int, **kw):
    c = engine_config("embedded", **kw)
    local = dataclasses.replace(c.local, shared_slots=shared_slots)
    return dataclasses.replace(c, local=local)


def test_alone_equals_the_cold_run() -> None:
    # Without sharing, each job alone: the next turn runs in an engine of its own.
    cold_cfg = engine_config("baseline", prefix_cache=False)
    cold, cold_logits, _, _, _ = asyncio.run(_run(cold_cfg, JOBS))
    jobs = JOBS + [_turn2(JOBS[0][0], cold[0])]
    more, more_logits, _, _, _ = asyncio.run(_run(cold_cfg, jobs[-1:]))
    tokens, logits, cached, guard, stats = asyncio.run(_run(cfg(REGION), jobs))
    assert cached == [j[3] for j in jobs]
    assert tokens == cold + more
    assert len(logits) == len(cold_logits + more_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, cold_logits + more_logits))
    assert not guard.violations and stats["requests"] == 0
    region = guard.backend.kv.shared
    assert int((region.key >= 0).sum()) > 0  # the cached rows went through the region


async def _together(c, prompts: list[tuple[int, ...]], n: int, svc=None):
    """The first prompt alone (its pages get published), then the others at once: their
    tokens, every step's logits and the region's copies (the service's `svc`: its rows in the
    region before the engine detaches, which empties it)."""
    engine = await build_engine(c)
    logits = record_logits(engine)
    engine.start()
    region = engine.compute.backend.kv.shared
    try:
        first = engine.api.submit(prompts[0], n, SamplingParams())
        async for _ in first.follow():
            pass
        reqs = [engine.api.submit(p, n, SamplingParams()) for p in prompts[1:]]
        await asyncio.gather(*(_drain(r) for r in reqs))
        assert all(r.finish is Finish.LENGTH for r in [first, *reqs])
        held = 0 if region is None else int((region.key >= 0).sum())
        if svc is not None:
            held = service_stats(svc).shared_rows
        tokens = [first.tokens] + [r.tokens for r in reqs]
        return tokens, logits, [r.cached_tokens for r in reqs], held
    finally:
        await engine.stop()


async def _drain(req) -> None:
    async for _ in req.follow():
        pass


def test_requests_on_one_prefix_decode_together_through_one_region() -> None:
    prompts = [SHARED + (3, 4, 5)] + [SHARED + (9, i, 8) for i in range(3)]
    off = asyncio.run(_together(_off(), prompts, 8))
    on = asyncio.run(_together(cfg(REGION), prompts, 8))
    assert on[2] == off[2] == [len(SHARED) // P * P] * 3
    assert on[0] == off[0]
    assert len(on[1]) == len(off[1]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    assert on[3] > 0 and off[3] == 0


def _off():
    """Without the region, as many request slots as with it (the same batches)."""
    c = engine_config("embedded")
    local = dataclasses.replace(c.local, max_requests=c.local.max_requests - 1)
    return dataclasses.replace(c, local=local)


def test_every_mode_equals_the_cold_run_with_the_region(svc) -> None:
    def mode_cfg(mode: str, **kw):
        if mode == "embedded":
            return cfg(REGION, **kw)
        return engine_config(mode, svc if "service" in mode else None, **kw)

    _every_mode(svc, mode_cfg)  # each service mode flushes: the region's pages are freed
    assert service_stats(svc).shared_rows == 0


@pytest.mark.gpu
def test_every_mode_equals_the_cold_run_with_the_region_on_gpu() -> None:
    """The same on CUDA: the Triton plan with the region, CUDA graphs, micro-batches (prompt
    pages only are shared, as in test_prefix_engine's GPU test)."""
    with workdir() as path:
        gpu_svc = start_service(path, layout=layout_with(shared_slots=REGION), device="cuda")
        try:

            def mode_cfg(mode: str, **kw):
                kw["prefix_share_generated"] = False
                c = (
                    cfg(REGION, **kw)
                    if mode == "embedded"
                    else engine_config(mode, gpu_svc if "service" in mode else None, **kw)
                )
                return setting_groups.replace(c, device="cuda")

            _every_mode(gpu_svc, mode_cfg, generated=False, watch=False)
            assert service_stats(gpu_svc).shared_rows == 0
        finally:
            assert gpu_svc.stop() == 0, gpu_svc.log()


@pytest.mark.parametrize("mode", ["service", "service-remote-swap"])
def test_service_modes_decode_together_through_the_services_region(svc, mode) -> None:
    prompts = [SHARED + (3, 4, 5)] + [SHARED + (9, i, 8) for i in range(3)]
    off = asyncio.run(_together(_off(), prompts, 8))
    on = asyncio.run(_together(engine_config(mode, svc), prompts, 8, svc))
    assert on[2] == off[2] == [len(SHARED) // P * P] * 3
    assert on[0] == off[0]
    assert len(on[1]) == len(off[1]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    assert on[3] > 0  # the session that held the region planned with it
    assert service_stats(svc).shared_rows == 0  # and its detach emptied it
    flush(svc)


def _live_pages(region) -> set[int]:
    """The pages of which the region holds rows that can still hit."""
    held = region.key >= 0
    page = torch.where(held, (region.key & 0xFFFFFFFF) // P, 0)
    current = held & ((region.key >> 32) == region.page_gen.long()[page])
    return set(page[current].tolist())


async def _tenants(c, prompt: tuple[int, ...], salts: list[str], n: int = 8):
    """The prompt under each salt in turn: per request its tokens, pages, cached tokens, and
    the pages whose rows entered the region while it ran."""
    engine = await build_engine(c)
    region = engine.compute.backend.kv.shared
    admit, pages = engine.control.admit, []

    async def watched(*args):
        adm = await admit(*args)
        pages.append(adm.pages)
        return adm

    engine.control.admit = watched
    engine.start()
    out = []
    try:
        for salt in salts:
            before = _live_pages(region)
            req = engine.api.submit(prompt, n, SamplingParams(), cache_salt=salt)
            await _drain(req)
            assert req.finish is Finish.LENGTH, req.error
            out.append((req.tokens, pages[-1], req.cached_tokens, _live_pages(region) - before))
        return out
    finally:
        await engine.stop()


@pytest.mark.parametrize("mode", ["embedded", "service"])
def test_tenants_never_share_pages_or_region_rows_and_a_tenant_does(svc, mode) -> None:
    """The same prompt under cache salts a, b, a, b (the gateway's X-Cache-Salt: tests/
    integration/test_gateway.py): each tenant's second request maps its own first one's
    prefix pages and reads their rows through the region; no page, so no region row, is the
    other tenant's. The tokens are the same four times."""
    c = cfg(REGION) if mode == "embedded" else engine_config(mode, svc)
    prompt = SHARED + (3, 4, 5)  # 27 tokens + 8 new: offloaded, 24 cached
    (a1, b1, a2, b2) = asyncio.run(_tenants(c, prompt, ["a", "b", "a", "b"]))
    assert [r[2] for r in (a1, b1, a2, b2)] == [0, 0, 24, 24]
    assert a1[0] == b1[0] == a2[0] == b2[0]
    prefix = 24 // P
    assert a2[1][:prefix] == a1[1][:prefix] and b2[1][:prefix] == b1[1][:prefix]
    # No page of a tenant's prefix (host rows, index keys) is in the other's page tables
    # (private pages, freed at a request's end, are reused by anyone).
    assert not set(a1[1][:prefix]) & set(b1[1] + b2[1])
    assert not set(b1[1][:prefix]) & set(a2[1])
    assert not a1[3] and not b1[3]  # nothing cached: nothing read through the region
    assert a2[3] and a2[3] <= set(a1[1][:prefix])
    assert b2[3] and b2[3] <= set(b1[1][:prefix])
    if mode == "service":
        flush(svc)


def test_the_region_is_refused_outside_embedded_mode_and_off_whole_buffers() -> None:
    with pytest.raises(ValueError, match="service's layout"):
        setting_groups.replace(cfg(REGION), kv_mode="baseline")
    with pytest.raises(ValueError, match="multiple of hot_slots"):
        cfg(REGION + 1)
