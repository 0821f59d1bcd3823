"""The engine's queue policy (engine_client/loop/scheduler.py), in-process on the baseline KV side
with an admission gate in front of it:
- a request the KV side refuses as permanently too large ends at once with INVALID_ARGUMENT
  and the numbers, and a small request behind it is served;
- smaller requests pass a head that waits for capacity, while the head is young;
- once the head is old, nothing passes it: it is admitted first when capacity frees;
- a request waiting longer than max_queue_wait ends with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract import errors
from engine_client.loop.request import FailStatus, Finish, SamplingParams
from engine_client.serve.factory import build_engine
from tests.process_harness import engine_config, wait_until

pytestmark = [pytest.mark.timeout(120)]

SMALL = (tuple(range(1, 9)), 4)  # 12 tokens
BIG = (tuple(range(1, 41)), 40)  # 80 tokens


@pytest.fixture(autouse=True)
def one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Gate:
    """A KV control that refuses admissions of more than `limit` tokens: for good when
    `permanent`, else for now. Records who was admitted, and counts refusals."""

    def __init__(self, inner, limit: int, permanent: bool) -> None:
        self.inner, self.limit, self.permanent = inner, limit, permanent
        self.admitted: list[str] = []
        self.refusals = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def admit(self, request_id: str, prompt_len: int, max_new_tokens: int, prefix=None):
        need = prompt_len + max_new_tokens
        if need > self.limit:
            self.refusals += 1
            e = errors.CapacityError(
                "not enough host pages",
                {"tokens_needed": str(need), "tokens_total": str(self.limit)},
            )
            e.permanent = self.permanent
            raise e
        self.admitted.append(request_id)
        return await self.inner.admit(request_id, prompt_len, max_new_tokens, prefix)


async def _engine(limit: int, permanent: bool, **cfg):
    engine = await build_engine(engine_config("baseline", **cfg))
    gate = Gate(engine.control, limit, permanent)
    engine.set_control(gate)
    engine.start()
    return engine, gate


async def _done(req) -> None:
    async for _ in req.follow():
        pass


def test_never_fitting_request_is_refused_at_once_and_the_next_is_served() -> None:
    async def run():
        engine, gate = await _engine(limit=20, permanent=True)
        try:
            big = engine.api.submit(*BIG, SamplingParams())
            small = engine.api.submit(*SMALL, SamplingParams())
            await asyncio.wait_for(asyncio.gather(_done(big), _done(small)), 60)
            return big, small, gate
        finally:
            await engine.stop()

    big, small, gate = asyncio.run(run())
    assert big.finish is Finish.ERROR and big.status is FailStatus.INVALID_ARGUMENT
    assert "tokens_needed=80" in big.error and "tokens_total=20" in big.error
    assert gate.refusals == 1  # refused once, not retried
    assert small.finish is Finish.LENGTH and len(small.tokens) == SMALL[1]


def test_smaller_requests_pass_a_young_blocked_head() -> None:
    async def run():
        engine, gate = await _engine(limit=20, permanent=False, skip_ahead=3600)
        try:
            big = engine.api.submit(*BIG, SamplingParams())
            small = engine.api.submit(*SMALL, SamplingParams())
            await asyncio.wait_for(_done(small), 60)
            waiting = big.request_id in [r.request_id for r in engine.waiting]
            return small, waiting
        finally:
            await engine.stop()

    small, big_still_waiting = asyncio.run(run())
    assert small.finish is Finish.LENGTH and big_still_waiting


@pytest.mark.parametrize(
    "policy", [{"skip_ahead": 0}, {"queue_policy": "fifo", "skip_ahead": 3600}], ids=["old", "fifo"]
)
def test_an_old_head_is_not_passed_and_is_admitted_first(policy) -> None:
    """Skip-ahead once the head is old, and FIFO always: the small request waits behind it."""

    async def run():
        engine, gate = await _engine(limit=20, permanent=False, **policy)
        try:
            big = engine.api.submit(*BIG, SamplingParams())
            small = engine.api.submit(*SMALL, SamplingParams())
            await wait_until(lambda: gate.refusals >= 3)  # retried: the small one could have passed
            held_back = not small.tokens and small.request_id not in gate.admitted
            gate.limit = 1000  # capacity comes back
            await asyncio.wait_for(asyncio.gather(_done(big), _done(small)), 60)
            return big, small, gate, held_back
        finally:
            await engine.stop()

    big, small, gate, held_back = asyncio.run(run())
    assert held_back
    assert gate.admitted == [big.request_id, small.request_id]
    assert big.finish is small.finish is Finish.LENGTH


def test_max_queue_wait_ends_a_request_that_waits_too_long() -> None:
    async def run():
        engine, gate = await _engine(limit=20, permanent=False, max_queue_wait=0.2)
        try:
            big = engine.api.submit(*BIG, SamplingParams())
            await asyncio.wait_for(_done(big), 30)
            return big
        finally:
            await engine.stop()

    big = asyncio.run(run())
    assert big.finish is Finish.ERROR and big.status is FailStatus.RESOURCE_EXHAUSTED
    assert "max queue wait 0.2 s" in big.error


def test_metrics_count_tokens_steps_and_device_time() -> None:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    async def run():
        engine = await build_engine(engine_config("baseline"))
        engine.start()
        try:
            reqs = [engine.api.submit(*SMALL, SamplingParams()) for _ in range(3)]
            await asyncio.wait_for(asyncio.gather(*map(_done, reqs)), 60)
            (host, port), stop = engine.metrics.serve(0)
            try:
                text = await asyncio.to_thread(
                    lambda: urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
                )
            finally:
                stop()
            return host, text, engine.steps
        finally:
            await engine.stop()

    host, text, steps = asyncio.run(run())
    assert host == "127.0.0.1"
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels or s.name.endswith(("_count", "_sum"))
    }
    n_tokens = 3 * SMALL[1]
    assert samples["engine_time_to_first_token_seconds_count"] == 3
    assert samples["engine_inter_token_latency_seconds_count"] == n_tokens - 3
    assert samples["engine_steps_total"] == steps > 0
    assert samples["engine_step_device_seconds_count"] == steps
    assert samples["engine_device_busy_seconds_total"] > 0
    assert 0 <= samples["engine_device_idle_fraction"] < 1
    assert samples["engine_queue_depth"] == 0 and samples["engine_running_requests"] == 0
