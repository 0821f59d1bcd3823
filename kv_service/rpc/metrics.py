"""Prometheus metrics of one service, in its own registry (no process-global state).

Counters and occupancy are read from the core at scrape time, so the core stays the single
source of truth; only RPC outcomes and latencies are recorded as they happen.

Names follow the Prometheus conventions: base units (seconds, bytes), `_total` only on counters
(capacities are `_capacity` gauges), and the RPC series of go-grpc-prometheus
(`grpc_server_started_total`, `grpc_server_handled_total`, `grpc_server_handling_seconds`, labelled
`grpc_type`, `grpc_service`, `grpc_method` and, once finished, `grpc_code`) so stock gRPC
dashboards work unchanged. The histogram keeps `grpc_code` too, to tell fast refusals from work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kv_service.books.records import CoreStats
from transport.gc_heap import GcPauses
from transport.rpc_calls import LATENCY_BUCKETS, RpcMetrics

# The core's counters: (series, help, CoreStats field).
_COUNTERS = (
    ("kvs_hits", "top-k positions served from the hot buffer", "hits"),
    ("kvs_misses", "top-k positions copied from the host tier", "misses"),
    ("kvs_host_to_device_bytes", "bytes copied host -> device", "bytes_moved"),
    ("kvs_admitted", "requests admitted", "admitted_total"),
    ("kvs_rejected", "admissions refused for capacity", "rejected_total"),
    ("kvs_expired_sessions", "sessions whose lease expired", "expired_sessions_total"),
    ("kvs_prefix_lookups", "admissions that looked up a cached prefix", "prefix_lookups_total"),
    (
        "kvs_prefix_lookup_tokens",
        "prompt tokens of admissions that looked up a cached prefix",
        "prefix_lookup_tokens_total",
    ),
    (
        "kvs_prefix_hit_tokens",
        "prompt tokens found in the prefix cache (not prefilled)",
        "prefix_hit_tokens_total",
    ),
    (
        "kvs_prefix_evicted_pages",
        "cached prefix pages evicted to admit requests",
        "evicted_pages_total",
    ),
)
# Occupancy with a capacity: (series stem, help, used field, capacity field).
_OCCUPANCY = (
    (
        "kvs_host_pages",
        "host-tier pages holding offloaded requests",
        "offloaded_pages_used",
        "pages_total",
    ),
    (
        "kvs_index_pages",
        "index-key pool pages reserved (all requests)",
        "pages_used",
        "pages_total",
    ),
    ("kvs_device_slots", "request slots (hot buffers) in use", "slots_used", "slots_total"),
)
# Plain gauges: (series, help, CoreStats field).
_GAUGES = (
    ("kvs_prefix_cached_pages", "pages holding a cached prefix page", "cached_pages"),
    (
        "kvs_prefix_evictable_pages",
        "cached prefix pages no request uses (evictable)",
        "evictable_pages",
    ),
    ("kvs_sessions", "live sessions", "sessions"),
    ("kvs_requests", "live requests", "requests"),
)


class _CoreCollector(Collector):
    def __init__(self, stats: Callable[[], CoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        for name, doc, field in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
        for name, doc, used, total in _OCCUPANCY:
            yield GaugeMetricFamily(f"{name}_used", doc, value=getattr(s, used))
            yield GaugeMetricFamily(f"{name}_capacity", f"{doc}: capacity", value=getattr(s, total))
        for name, doc, field in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(s, field))
        yield GaugeMetricFamily("kvs_draining", "1 while draining", value=int(s.draining))


class ServiceMetrics:
    """RPC counters and latency histograms plus, once bound, the core's counters and occupancy."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(r)
        self.gc = GcPauses("kvs")  # recording once serve() installs it
        r.register(self.gc)
        self.message_seconds = Histogram(
            "kvs_session_message_seconds",
            "server time per message of a Session stream",
            ["message", "code"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.swap_seconds = Histogram(
            "kvs_remote_swap_seconds",
            "service time of one RemoteSwap layer",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def bind(self, stats: Callable[[], CoreStats]) -> None:
        self.registry.register(_CoreCollector(stats))

    def observe_message(self, message: str, code: str, seconds: float) -> None:
        self.message_seconds.labels(message=message, code=code).observe(seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Callable[[], None]:
        """Start the /metrics HTTP endpoint; returns its stop function."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        return stop
