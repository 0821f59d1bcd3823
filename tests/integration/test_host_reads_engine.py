"""Host reads (issue 40: KVLayout.host_reads) through the real engine on CPU with the reference
kernels, in every mode with hot buffers: embedded (its own layout), service and
service-remote-swap (a service process started with --host-reads 1). The private buffer is
W + 4 = 12 rows for top-k 16, so every offloaded step's selection outside the 8-token window
(at least 8 rows once a request holds 24 tokens) overflows the 4 LRU slots and attention reads
the rest from the host tier. Tokens and every step's logits equal the baseline's bitwise, with
prefix caching on (cached rows read through the same path), and the service ends empty; the
same beside a shared hot region (issue 40's capacity layout: cached prefix rows in the region,
the private overflow from the host tier)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from tests.engine_client.loop.test_engine import one_cpu_thread  # noqa: F401 (autouse fixture)
from tests.integration.test_prefix_engine import JOBS, _run
from tests.process_harness import (
    LOCAL,
    engine_config,
    flush,
    layout_with,
    service_stats,
    start_service,
    workdir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HOST_READS = dict(hot_slots=LOCAL.window + 4, host_reads=True)


@pytest.fixture(scope="module")
def svc():
    with workdir() as path:
        service = start_service(path, layout=layout_with(**HOST_READS))
        try:
            yield service
        finally:
            assert service.stop() == 0, service.log()
        assert service.segment_files() == []


def cfg(mode: str, svc=None, **kw):
    c = engine_config(mode, svc if mode.startswith("service") else None, **kw)
    if mode != "embedded":
        return c
    return dataclasses.replace(c, local=dataclasses.replace(c.local, **HOST_READS))


@pytest.mark.parametrize("mode", ["embedded", "service", "service-remote-swap"])
def test_host_reads_give_the_baseline_bitwise(svc, mode) -> None:
    cold, cold_logits, *_ = asyncio.run(_run(cfg("baseline", prefix_cache=False), JOBS))
    tokens, logits, _, _, stats = asyncio.run(_run(cfg(mode, svc), JOBS, watch=False))
    assert tokens == cold
    assert len(logits) == len(cold_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, cold_logits))
    assert stats["requests"] == 0
    if mode != "embedded":
        flush(svc)
        s = service_stats(svc)
        assert s.requests == 0 and s.request_slots.used == 0 and s.host_pages.used == 0, s


REGION = dict(HOST_READS, shared_slots=2 * HOST_READS["hot_slots"])  # 2 of 4 request slots


@pytest.mark.parametrize("mode", ["embedded", "service"])
def test_host_reads_beside_a_shared_region(mode) -> None:
    """Issue 40's capacity layout: cached prefix rows in the shared region, the private
    overflow read from the host tier; bitwise the baseline's, and the region was used."""
    cold, cold_logits, *_ = asyncio.run(_run(cfg("baseline", prefix_cache=False), JOBS))
    with workdir() as path:
        svc = start_service(path, layout=layout_with(**REGION)) if mode == "service" else None
        try:
            c = cfg(mode, svc)
            if mode == "embedded":
                c = dataclasses.replace(c, local=dataclasses.replace(c.local, **REGION))
            tokens, logits, _, guard, _ = asyncio.run(_run(c, JOBS, watch=False))
            if svc is None:  # the service empties its region when the session closes
                assert int((guard.backend.kv.shared.key >= 0).sum()) > 0
        finally:
            assert svc is None or svc.stop() == 0
    assert tokens == cold
    assert len(logits) == len(cold_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, cold_logits))


def test_the_service_refuses_a_small_buffer_without_host_reads() -> None:
    with pytest.raises(ValueError, match="host_reads"):
        layout_with(hot_slots=LOCAL.window + 4)
