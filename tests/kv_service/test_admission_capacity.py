"""Admission counts what a request really adds (issue 40, item 2): at one GPU budget, the layout
contract.capacity fits holds exactly as many requests as the service core then admits, every
count being the core's own (a request slot: its private hot buffer and residency; its private
pages and growth; a cached prefix's pages once; the shared region once), and more requests with
sharing than without, more again with shared hot rows (whose private buffers hold only W + k
rows). device_bytes is what allocation takes, byte for byte. Releasing every request and a Flush
leave the pools, and the region, empty."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from contract.capacity import Workload, device_bytes, fit, sized
from contract.errors import CapacityError
from contract.layout import KVLayout
from contract.prefix import page_hashes
from kv_service.core import ServiceCore
from kv_service.memory.store import allocate_local

# 2 layers, k 8, W 4, P 4; requests of 64 tokens whose first 48 (12 pages) are common.
BIG = KVLayout(2, 2, 32, 4, 8, 4, 32, 64, "bf16", "fp8")
SMALL = dataclasses.replace(BIG, hot_slots=16, max_requests=4, shared_slots=48)  # W + k <= 16
PREFIX = list(range(1, 49))
NEW = 15  # prompts of 49 tokens + 15 new = 64 reserved
SHARED, ALONE = Workload(64, 48), Workload(64)


def allocated_device_bytes(layout: KVLayout) -> int:
    """Bytes of every allocated tensor but the host tier, the region's and its scratch too."""
    kv = allocate_local(layout)
    host = ("host_kv", "host_rows")
    tensors = [getattr(kv, f.name) for f in dataclasses.fields(kv) if f.name not in host]
    if kv.shared is not None:
        region = kv.shared
        tensors += [getattr(region, f.name) for f in dataclasses.fields(region)]
        tensors += [getattr(region.scratch, f.name) for f in dataclasses.fields(region.scratch)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("layout", [BIG, SMALL, dataclasses.replace(SMALL, row_format="fp8")])
def test_device_bytes_are_what_allocation_takes(layout):
    assert device_bytes(layout) == allocated_device_bytes(layout)


def admit_until_full(layout: KVLayout, sharing: bool) -> int:
    """Requests of 49 prompt tokens (the common 48, then their own) admitted until capacity
    refuses one; then all released and the prefix cache flushed, leaving nothing held."""
    core = ServiceCore(allocate_local(layout), lease_seconds=5.0)
    sid = core.attach("eng", fingerprint="m").session_id
    names = lambda i: page_hashes(PREFIX + [100 + i], layout.page_size) if sharing else []  # noqa: E731
    admitted = 0
    try:
        while True:
            r = core.admit(sid, f"r{admitted}", len(PREFIX) + 1, NEW, names(admitted))
            if admitted == 0:
                core.commit(sid, r.request_id, len(PREFIX) + 1)  # publishes the prefix's pages
            assert r.cached_tokens == (len(PREFIX) if sharing and admitted else 0)
            admitted += 1
    except CapacityError:
        pass
    for i in range(admitted):
        core.release(sid, f"r{i}")
    core.flush()
    core.check()
    s = core.stats()
    assert s.slots_used == 0 and s.pages_used == 0 and s.cached_pages == 0
    if core.kv.shared is not None:
        assert core.kv.shared.live(layout.page_size) == 0
    return admitted


def test_one_budget_admits_more_with_sharing_and_more_with_shared_rows():
    budget = device_bytes(sized(BIG, ALONE, 8))
    counts = []
    for template, work, sharing in (
        (BIG, ALONE, False),
        (BIG, SHARED, True),
        (SMALL, SHARED, True),
    ):
        layout = fit(template, work, budget)
        requests = layout.max_requests - layout.shared_slots // layout.hot_slots
        assert device_bytes(layout) <= budget < device_bytes(sized(template, work, requests + 1))
        assert admit_until_full(layout, sharing) == requests  # the fit's count is the core's
        counts.append(requests)
    assert counts[0] == 8 and counts[0] < counts[1] < counts[2], counts
