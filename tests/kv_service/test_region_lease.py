"""Who plans with the service's shared hot region (kv_service/memory/region_lease.py): one
session at a time; its holder's close frees the region and empties it (the requests keep their
shared_len); a remote-swap session waiting for it takes it at the first layer 0 after.
tests/integration/test_shared_region_lease.py does the same through a real service."""

from __future__ import annotations

import torch

from contract.layout import KVLayout
from engine_client.kv.remote_swap import allocate_exchange
from kv_service.memory.region_lease import RegionLease
from kv_service.memory.remote_swap import RemoteSwapper
from kv_service.memory.store import allocate_local

LAYOUT = KVLayout(
    num_layers=2,
    max_requests=3,
    hot_slots=12,
    window=2,
    topk=4,
    page_size=4,
    num_pages=16,
    max_context=30,
    shared_slots=12,
)


def _dirty(region) -> None:
    """Some rows in the region, read at step 3, and a request slot's shared prefix."""
    region.key[:, :2] = torch.tensor([5, 9])
    region.index[:, :2] = torch.tensor([0, 1], dtype=torch.int32)
    region.last[:, :2] = 3
    region.order[:] = torch.arange(LAYOUT.shared_slots - 1, -1, -1, dtype=torch.int32)
    region.shared_len[1] = 8


def _is_empty(region) -> bool:
    S = LAYOUT.shared_slots
    return (
        bool((region.key == -1).all() and (region.index == -1).all())
        and bool((region.last == -1).all())
        and torch.equal(region.order, torch.arange(S, dtype=torch.int32).expand(2, S))
    )


def test_the_holders_close_frees_and_empties_the_region() -> None:
    kv = allocate_local(LAYOUT)
    region = kv.shared
    lease = RegionLease(region)
    assert lease.grant("a") and not lease.grant("b") and lease.grant("a")
    _dirty(region)
    lease.session_closed("b")  # not the holder: nothing changes
    assert lease.holds("a") and not _is_empty(region)
    lease.session_closed("a")
    assert lease.holder is None and _is_empty(region)
    assert region.live(LAYOUT.page_size) == 0
    assert region.shared_len[1] == 8  # the request's, kept
    assert lease.grant("b")


def test_without_a_region_nobody_holds_one() -> None:
    lease = RegionLease(None)
    assert not lease.present and not lease.grant("a") and not lease.holds("a")
    lease.session_closed("a")
    lease.empty()


def test_a_waiting_remote_swap_session_takes_the_region_at_layer_0() -> None:
    kv = allocate_local(LAYOUT)
    lease = RegionLease(kv.shared)
    swapper = RemoteSwapper(kv, allocate_exchange(LAYOUT), lease)
    lease.grant("engine")  # an in-stream engine's session holds it
    swapper.claim("remote")
    swapper.x["xchg_req_slots"][:] = -1  # padding rows: nothing planned
    step = int(kv.shared.step)
    swapper.run("remote", 0, 1, set())
    assert lease.holds("engine") and int(kv.shared.step) == step  # planned privately
    swapper.session_closed("engine")
    swapper.run("remote", 1, 1, set())  # mid-step: not yet
    assert lease.holder is None
    swapper.run("remote", 0, 1, set())
    assert lease.holds("remote") and int(kv.shared.step) == step + 1
    swapper.session_closed("remote")
    assert lease.holder is None and swapper.owner is None
