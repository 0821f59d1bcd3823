"""The admission limit wired into the engine (engine_client/loop/scheduler.py, engine.py), on the
CPU in embedded mode, with the engine's measured decode time replaced by a model of the batch N:
- throughput N / t(N) peaking at N = 4: the engine stops admitting there (one bucket of
  overshoot while it finds out), the requests behind wait and are all served, and /metrics
  shows the limit it settled on;
- step time linear in N: every request raises throughput, so it admits up to --max-batch."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from contract import setting_groups
from engine_client.loop.admission_limit import AdmissionLimit, AdmissionSettings
from engine_client.loop.request import Finish, SamplingParams
from engine_client.serve.factory import build_engine
from engine_client.serve.settings.local_layout import LocalLayout
from tests.process_harness import engine_config

pytestmark = [pytest.mark.timeout(120)]

CAPACITY = 12
PROMPT, NEW = tuple(range(1, 9)), 24
# Buckets two batch sizes wide; no trial after the first climb within the test.
SETTINGS = AdmissionSettings(samples=2, hysteresis=0.04, explore_steps=10_000)


def peaked(n: int) -> float:
    """N / t(N) peaks at N = 4: 1.6 at N = 2, 2.0 at 4, 1.85 at 6, 1.6 at 8."""
    return 1e-3 * (1 + n * n / 16)


def linear(n: int) -> float:
    return 1e-3 * (1 + n)


@dataclasses.dataclass
class Modelled(AdmissionLimit):
    """An adaptive limit told `curve(N)` instead of the measured decode time; records both."""

    curve: Callable[[int], float] = linear
    rows: list[int] = dataclasses.field(default_factory=list)
    measured: list[float] = dataclasses.field(default_factory=list)

    def observe(self, rows: int, seconds: float, waiting: bool) -> None:
        self.rows.append(rows)
        self.measured.append(seconds)
        super().observe(rows, self.curve(rows), waiting)


async def _done(req) -> None:
    async for _ in req.follow():
        pass


async def _serve_all(limit: Modelled, device: str = "cpu") -> tuple[list, float | None]:
    local = LocalLayout(
        max_requests=CAPACITY, hot_slots=32, window=8, page_size=8, num_pages=64, max_context=64
    )
    cfg = setting_groups.replace(
        engine_config("embedded"), local=local, max_batch=CAPACITY, device=device
    )
    engine = await build_engine(cfg)
    built = engine.scheduler.admission
    assert built.adaptive  # auto: adaptive in a HiSparse mode, over the decode graphs' sizes
    assert built.padded == engine.compute.model_runner.cfg.buckets == (1, 2, 4, 8, CAPACITY)
    engine.scheduler.admission = limit
    engine.metrics.watch_admission(limit)
    engine.start()
    try:
        reqs = [engine.api.submit(PROMPT, NEW, SamplingParams()) for _ in range(2 * CAPACITY)]
        await asyncio.wait_for(asyncio.gather(*map(_done, reqs)), 60)
        return reqs, engine.metrics.registry.get_sample_value("engine_admission_limit")
    finally:
        await engine.stop()


def test_the_engine_stops_admitting_where_throughput_peaks() -> None:
    limit = Modelled(CAPACITY, SETTINGS, start=1, curve=peaked)  # a climb from the bottom
    reqs, shown = asyncio.run(_serve_all(limit))
    assert all(r.finish is Finish.LENGTH and len(r.tokens) == NEW for r in reqs)
    assert limit.limit == shown == 4
    assert max(limit.rows) <= 6  # the bucket above 4 was tried, then left
    assert limit.rows.count(4) > limit.rows.count(6)


def test_linear_step_times_admit_up_to_max_batch() -> None:
    limit = Modelled(CAPACITY, SETTINGS, curve=linear)
    reqs, shown = asyncio.run(_serve_all(limit))
    assert all(r.finish is Finish.LENGTH for r in reqs)
    assert limit.limit == shown == CAPACITY and max(limit.rows) == CAPACITY
    assert all(s > 0 for s in limit.measured)  # the runner timed every step's decode part


@pytest.mark.gpu
def test_the_decode_part_of_every_step_is_timed_on_gpu() -> None:
    """CUDA (graphs, Triton kernels): the event between the prefill chunk and the decode rows
    times each step's decode part, and the limit climbs as on the CPU."""
    limit = Modelled(CAPACITY, SETTINGS, curve=linear)
    reqs, shown = asyncio.run(_serve_all(limit, "cuda"))
    assert all(r.finish is Finish.LENGTH for r in reqs) and shown == CAPACITY
    assert all(0 < s < 1 for s in limit.measured)
