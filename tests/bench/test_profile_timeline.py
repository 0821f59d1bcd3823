"""bench/profile/timeline.py: the device timeline of a profiled step from kernel intervals (the
miss copy against every other kernel), on synthetic records; and the records a real CPU profile
yields (no device activity there)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bench.profile.timeline import common, covered, kernel_records, timeline, union


def test_union_merges_overlapping_and_touching_spans_and_drops_empty_ones() -> None:
    assert union([(5, 8), (0, 3), (3, 4), (7, 9), (10, 10)]) == [(0, 4), (5, 9)]
    assert covered(union([(0, 10), (2, 3)])) == 10


def test_common_time_of_two_unions() -> None:
    a, b = union([(0, 10), (20, 30)]), union([(5, 25), (28, 40)])
    assert common(a, b) == 5 + 5 + 2
    assert common(a, []) == 0


def test_a_step_splits_into_model_copy_alone_and_idle() -> None:
    """Two steps of: copy [0, 10) us on a side stream; model kernels [5, 8) and [12, 20) (two
    streams' kernels [12, 16) and [14, 20) overlapping count once); nothing in [10, 12)."""
    step = [
        ("_miss_copy_kernel", 0, 10_000),
        ("gemm", 5_000, 8_000),
        ("_score_kernel", 12_000, 16_000),
        ("elementwise", 14_000, 20_000),
    ]
    records = step + [(n, s + 20_000, e + 20_000) for n, s, e in step]
    t = timeline(records, steps=2)
    assert t == {
        "window_us": 20.0,
        "model_us": 11.0,
        "copy_us": 10.0,
        "overlap_us": 3.0,
        "copy_alone_us": 7.0,
        "idle_us": 2.0,
    }
    assert t["model_us"] + t["copy_alone_us"] + t["idle_us"] == t["window_us"]


@pytest.mark.parametrize("steps", [0, 1])
def test_nothing_profiled_gives_no_timeline(steps) -> None:
    assert timeline([], steps) == {}


def test_a_cpu_profile_has_no_device_records() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64).add_(1)
    assert kernel_records(prof) == []


class _Event:
    def __init__(self, name: str, device: object, start: int, end: int) -> None:
        self._v = (name, device, start, end)

    def name(self) -> str:
        return self._v[0]

    def device_type(self) -> object:
        return self._v[1]

    def start_ns(self) -> int:
        return self._v[2]

    def end_ns(self) -> int:
        return self._v[3]


def test_only_device_activities_become_records() -> None:
    """The kernels a CUDA profile holds (kineto's device events), not the host ops beside them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    events = [
        _Event("aten::mm", DeviceType.CPU, 0, 50),
        _Event("_miss_copy_kernel", DeviceType.CUDA, 10, 40),
        _Event("gemm", DeviceType.CUDA, 20, 30),
    ]
    prof = SimpleNamespace(
        profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events))
    )
    assert kernel_records(prof) == [("_miss_copy_kernel", 10, 40), ("gemm", 20, 30)]
