"""What the device does over a profiled decode step: the miss copy's kernels against every other
kernel (the model's, on whichever stream), as unions of the profiler's kernel intervals.

Why: run AE (docs/BENCHMARKS.md) took 0.44 ms of kernel time out of the fp8 step at N 222 (the
e4m3 indexer) and the step did not move. Kernel sums cannot say why; the timeline can. Per step:
- model: time any non-copy kernel runs (the main stream's work, and its interference slowdowns);
- copy: time a miss-copy kernel runs; overlap: both at once;
- copy alone: the copy runs and nothing else does, the model waiting on it (its exposure);
- idle: nothing runs (launch gaps, host work between steps).
model + copy alone + idle is the profiled window. `bench.profile.copy_cost` splits the copy's cost
from two profiles (with and without the copy); this reads one profile's own timeline.
"""

from __future__ import annotations

from collections.abc import Iterable

# The miss copy's Triton kernel (kernels/swap/miss_copy.py), by name.
COPY_KERNEL = "miss_copy"

Span = tuple[int, int]  # [start, end) in ns


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering the same time as `spans`."""
    out: list[Span] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def covered(spans: list[Span]) -> int:
    """Time a union of spans covers."""
    return sum(e - s for s, e in spans)


def common(a: list[Span], b: list[Span]) -> int:
    """Time two unions (sorted, disjoint) cover at once."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(records: Iterable[tuple[str, int, int]], steps: int) -> dict[str, float]:
    """µs per step of each part (module doc) from (kernel name, start ns, end ns) records of
    `steps` profiled steps."""
    records = list(records)
    if not records or steps < 1:
        return {}
    copy = union((s, e) for name, s, e in records if COPY_KERNEL in name)
    model = union((s, e) for name, s, e in records if COPY_KERNEL not in name)
    window = max(e for _, _, e in records) - min(s for _, s, _ in records)
    busy_model, busy_copy, both = covered(model), covered(copy), common(copy, model)
    parts = {
        "window": window,
        "model": busy_model,
        "copy": busy_copy,
        "overlap": both,
        "copy_alone": busy_copy - both,
        "idle": window - (busy_model + busy_copy - both),  # the time neither covers
    }
    return {f"{k}_us": v / 1e3 / steps for k, v in parts.items()}


def kernel_records(prof) -> list[tuple[str, int, int]]:
    """The device activities (kernels, copies, fills) of a torch.profiler run, as records."""
    from torch.autograd import DeviceType

    return [
        (e.name(), e.start_ns(), e.end_ns())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA
    ]


def print_timeline(t: dict[str, float]) -> None:
    if not t:
        return
    print(
        f"device timeline a step ({t['window_us'] / 1e3:.3f} ms profiled): model kernels "
        f"{t['model_us'] / 1e3:.3f} ms, miss copy {t['copy_us'] / 1e3:.3f} ms "
        f"({t['overlap_us'] / 1e3:.3f} beside the model, {t['copy_alone_us'] / 1e3:.3f} alone: "
        f"the model waiting on it), idle {t['idle_us'] / 1e3:.3f} ms"
    )
