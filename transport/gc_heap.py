"""The garbage collector in the serving processes (the engine, the KV service): the start-up heap
frozen once the process is warm, and the time its collections take, for /metrics.

Why: CPython's full collection (generation 2) walks every tracked object. After its imports
alone (torch, triton, grpc, our packages) a process holds ~190K of them, and a full collection
takes 38-48 ms on the development machine's CPU; compiled kernels and captured graphs add more.
The engine's step loop prepares the next step on the host while the GPU runs this one, so a
collection longer than a step leaves the GPU idle: bench.e2e (docs/BENCHMARKS.md, run O) saw
~120 ms token gaps at max N, one or two a second, against a 14 ms p50. `gc.freeze()` moves every
object alive at that point into the permanent generation, which later collections skip, so a
full collection then walks only what the process allocated since (vLLM and SGLang freeze after
their warm-up the same way). Objects made later are collected as before: nothing leaks.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze what survives. Call once the process is
    warm (kernels compiled, graphs captured), before it reports SERVING. Returns the number of
    objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcTotals(NamedTuple):
    seconds: float = 0.0  # all generations
    full_collections: int = 0  # generation 2
    full_seconds: float = 0.0
    longest: float = 0.0


class GcPauses(Collector):
    """Seconds spent in collections (all generations; full ones counted apart) and the longest
    pause, recorded by a gc callback and read by the scrape thread. No lock: the callback runs
    inside a collection, which any allocation may start, also one made while a lock is held (a
    deadlock); it replaces `totals` with a new tuple in one assignment, and a reader takes that
    one reference. Metric names start with `prefix` (engine, kvs)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.totals = GcTotals()
        self._t0: float | None = None

    def install(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:  # installed during a collection
            return
        dt, self._t0 = time.perf_counter() - self._t0, None
        t, full = self.totals, info.get("generation") == 2
        self.totals = GcTotals(
            t.seconds + dt,
            t.full_collections + full,
            t.full_seconds + (dt if full else 0.0),
            max(t.longest, dt),
        )

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        p, t = self.prefix, self.totals
        yield CounterMetricFamily(
            f"{p}_gc_seconds", "seconds in garbage collections, all generations", value=t.seconds
        )
        yield CounterMetricFamily(
            f"{p}_gc_full_seconds", "seconds in full (generation 2) collections",
            value=t.full_seconds,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_gc_full_collections", "full (generation 2) collections",
            value=t.full_collections,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{p}_gc_pause_max_seconds", "the longest collection since start", value=t.longest
        )
