"""Prometheus metrics of one engine, in its own registry (no process-global state).

Device time is named `device`, not `gpu`: on CPU the "device" is the CPU. `engine_info` says which
(`device="cpu"` or `"cuda:0"`) and the KV mode. The engine's gRPC calls are counted in the
go-grpc-prometheus series (`transport.rpc_calls.RpcMetrics`), as the KV service's are.

Per-token latencies go through a `BatchHistogram`: a step observes all its tokens in one call
(a bisect per value), cheaper than prometheus_client's locked `observe` per token on the per-step
host path. Everything else is updated once per step. Names follow Prometheus conventions: base
units (seconds), `_total` only on counters.

`/metrics` listens on 127.0.0.1 unless told otherwise (`--metrics-address`), like the service's.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from engine_client.loop.admission_limit import AdmissionLimit
from transport.gc_heap import GcPauses
from transport.rpc_calls import RpcMetrics

# Token latencies: 1 ms .. 20 s. Step times: 50 us .. 2 s.
TOKEN_BUCKETS = (
    1e-3,
    2e-3,
    4e-3,
    8e-3,
    12e-3,
    16e-3,
    20e-3,
    25e-3,
    30e-3,
    40e-3,
    60e-3,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    20.0,
)
STEP_BUCKETS = (
    50e-6,
    100e-6,
    200e-6,
    500e-6,
    1e-3,
    2e-3,
    4e-3,
    8e-3,
    12e-3,
    16e-3,
    20e-3,
    25e-3,
    32e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
)
# Steps over which the GPU idle fraction gauge is computed.
IDLE_WINDOW = 64


# The admission limit's gauges: name, help, and the field of `AdmissionLimit.view()` shown.
ADMISSION_GAUGES = (
    ("engine_admission_limit", "most requests admitted to run at once now", "limit"),
    (
        "engine_admission_estimate_rows_per_second",
        "estimated decode rows per second of decode time at the admission limit's batch",
        "tok_s",
    ),
    (
        "engine_admission_best_batch",
        "the batch size with the best recent estimate (0: none yet)",
        "best_batch",
    ),
)


class BatchHistogram(Collector):
    """A histogram fed many values at a time from one thread, read by the scrape thread."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, list(buckets)
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: Iterable[float]) -> None:
        counts, bounds = self._counts, self.bounds
        total = 0.0
        with self._lock:
            for v in values:
                counts[bisect.bisect_left(bounds, v)] += 1
                total += v
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, c in zip(self.bounds + [float("inf")], counts):
            cumulative += c
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(r)
        self.info = Info("engine", "what this engine runs on", registry=r)
        self.gc = GcPauses("engine")  # recording once serve() installs it
        r.register(self.gc)
        self._token_metrics(r)
        self._load_metrics(r)
        self._step_metrics(r)
        self._speculative_metrics(r)
        self._admission_metrics(r)
        self._window: deque[tuple[float, float]] = deque(maxlen=IDLE_WINDOW)

    def _token_metrics(self, r: CollectorRegistry) -> None:
        """Per-token latencies, as the client sees them."""
        self.ttft = BatchHistogram(
            "engine_time_to_first_token_seconds", "submit to first token delivered", TOKEN_BUCKETS
        )
        self.itl = BatchHistogram(
            "engine_inter_token_latency_seconds",
            "time between two tokens of a request, as delivered",
            TOKEN_BUCKETS,
        )
        r.register(self.ttft)
        r.register(self.itl)

    def _load_metrics(self, r: CollectorRegistry) -> None:
        """How full the engine is: the batch, the queue, the admitted requests."""
        self.batch_size = Gauge("engine_batch_size", "decode rows in the last step", registry=r)
        self.queue_depth = Gauge("engine_queue_depth", "requests waiting for admission", registry=r)
        self.running = Gauge(
            "engine_running_requests", "admitted requests (prefill or decode)", registry=r
        )

    def _step_metrics(self, r: CollectorRegistry) -> None:
        """Where a step's time goes: device busy and idle, host."""
        self.step_device = Histogram(
            "engine_step_device_seconds",
            "device busy time of one step (CPU mode: its compute time)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_host = Histogram(
            "engine_step_host_seconds",
            "host time of one engine turn (schedule, launch, post-process), waits excluded",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.host_per_request = Gauge(
            "engine_step_host_seconds_per_request",
            "host time of the last step / its requests",
            registry=r,
        )
        self.device_idle_fraction = Gauge(
            "engine_device_idle_fraction",
            f"device idle time between back-to-back steps / wall time, last {IDLE_WINDOW} steps",
            registry=r,
        )
        self.device_busy = Counter(
            "engine_device_busy_seconds", "device busy time in steps", registry=r
        )
        self.device_idle = Counter(
            "engine_device_idle_seconds", "device idle time between back-to-back steps", registry=r
        )
        self.steps = Counter("engine_steps", "steps run", registry=r)

    def _admission_metrics(self, r: CollectorRegistry) -> None:
        """The admission limit (engine_client.loop.admission_limit), read at each scrape."""
        self.admission = {
            field: Gauge(name, doc, registry=r) for name, doc, field in ADMISSION_GAUGES
        }

    def watch_admission(self, limit: AdmissionLimit) -> None:
        """Show `limit` (its view is taken at each scrape, from the scrape thread: plain reads)."""
        for field, gauge in self.admission.items():
            gauge.set_function(_view_field(limit, field))

    def describe(self, device: str, kv_mode: str) -> None:
        self.info.info({"device": device, "kv_mode": kv_mode})

    def step(self, rows: int, device_seconds: float, idle_before: float | None) -> None:
        self.steps.inc()
        self.batch_size.set(rows)
        self.step_device.observe(device_seconds)
        self.device_busy.inc(device_seconds)
        if idle_before is not None:
            idle = max(0.0, idle_before)
            self.device_idle.inc(idle)
            self._window.append((device_seconds, idle))
            busy = sum(b for b, _ in self._window)
            idle_sum = sum(i for _, i in self._window)
            self.device_idle_fraction.set(idle_sum / (busy + idle_sum) if busy + idle_sum else 0.0)

    def _speculative_metrics(self, r: CollectorRegistry) -> None:
        self.drafted = Counter(
            "engine_spec_drafted_tokens", "draft tokens verified (speculative steps)", registry=r
        )
        self.accepted = Counter(
            "engine_spec_accepted_tokens", "draft tokens accepted (speculative steps)", registry=r
        )
        self.acceptance = Gauge(
            "engine_spec_acceptance_rate", "accepted / drafted tokens of the last step", registry=r
        )
        self.step_misses = Gauge(
            "engine_step_swap_misses",
            "KV rows the last step copied from the host tier (a verify step's rows share them)",
            registry=r,
        )
        self.step_misses_rows = Gauge(
            "engine_step_swap_misses_rows",
            "the last step's misses summed over its rows, as if each row were planned alone",
            registry=r,
        )
        self.misses = Counter(
            "engine_swap_misses", "KV rows copied from the host tier (steps' swap-ins)", registry=r
        )
        self.misses_rows = Counter(
            "engine_swap_misses_rows",
            "misses summed over each step's rows, as if each row were planned alone",
            registry=r,
        )

    def speculative(self, drafted: int, accepted: int, misses: int, rows_missed: int) -> None:
        """One step's drafts and swap misses (with and without the rows' shared plan)."""
        self.step_misses.set(misses)
        self.step_misses_rows.set(rows_missed)
        self.misses.inc(misses)
        self.misses_rows.inc(rows_missed)
        if drafted:
            self.drafted.inc(drafted)
            self.accepted.inc(accepted)
            self.acceptance.set(accepted / drafted)

    def host(self, seconds: float, requests: int) -> None:
        self.step_host.observe(seconds)
        if requests:
            self.host_per_request.set(seconds / requests)

    def queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def serve(
        self, port: int, addr: str = "127.0.0.1"
    ) -> tuple[tuple[str, int], Callable[[], None]]:
        """Start the /metrics HTTP endpoint (port 0: any free port); returns the address it
        listens on and its stop function."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        host, port = server.server_address[:2]
        return (str(host), port), stop  # str(): an AF_INET server's host is already a str


def _view_field(limit: AdmissionLimit, field: str) -> Callable[[], float]:
    """Reads one field of the limit's current view (a gauge's value at each scrape)."""
    return lambda: getattr(limit.view(), field)
