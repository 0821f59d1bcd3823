"""How benchmarks time things: device ceilings, graph-replay GPU time, CPU cost per call."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Row:
    """One line of a benchmark table: a measurement and its same-run comparison."""

    name: str
    case: str
    us: float
    ratio: float
    note: str = ""


def print_table(rows: list[Row]) -> None:
    print(f"\n{'kernel':<16} {'case':<34} {'us':>10} {'ratio':>8}  note")
    for r in rows:
        print(f"{r.name:<16} {r.case:<34} {r.us:>10.2f} {r.ratio:>8.3f}  {r.note}")


def events_ms(fn: Callable[[], None], reps: int, setup: Callable[[], None] | None = None) -> float:
    """Median ms of `fn` between two events, over `reps` calls (the device idle before each)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_us(
    fn: Callable[[], None], reps: int = 20, inner: int = 1, setup: Callable[[], None] | None = None
) -> float:
    """Median GPU time of one `fn` call: `inner` calls captured in one CUDA graph, replayed.

    `setup` runs (untimed) before every replay, e.g. to restore state a call mutates.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if setup is not None:
            setup()
        fn()  # compile and warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if setup is not None:
        setup()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    torch.cuda.synchronize()
    return 1000.0 * events_ms(graph.replay, reps, setup) / inner


def cpu_call_us(fn: Callable[[], None], calls: int = 200) -> float:
    """Host time of one call (launch cost): many calls back to back, divided."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / calls


def measure_ceilings() -> dict[str, float]:
    """Pinned host→device copy, device→device copy (read+write bytes) and bf16 matmul rate."""
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d_ms = events_ms(lambda: dev.copy_(host, non_blocking=True), 10)  # noqa: F821
    dev2 = torch.empty_like(dev)
    d2d_ms = events_ms(lambda: dev2.copy_(dev), 20)  # noqa: F821
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    mm_ms = events_ms(lambda: a @ b, 10)  # noqa: F821
    # Free memory now; pyflakes reads the lambdas' names as undefined after this (F821).
    del host, dev, dev2, a, b
    torch.cuda.empty_cache()
    return {
        "h2d_gbs": nbytes / h2d_ms / 1e6,
        "d2d_gbs": 2 * nbytes / d2d_ms / 1e6,
        "mm_tflops": 2 * n**3 / mm_ms / 1e9,
    }
