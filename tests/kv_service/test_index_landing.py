"""A GPU service's index keys from a prefill engine land in a host mirror of the pool
(kv_service/memory/index_landing.py) and reach the pool when the request lands (Prefilled):
exactly its private pages, never the shared pages of its cached prefix nor another request's.
On CPU the core runs over CPU tensors with a separate mirror: the same bookkeeping and copies."""

from __future__ import annotations

import pytest
import torch

from contract.layout import KVLayout
from contract.prefix import page_hashes
from kv_service.core import ServiceCore
from kv_service.memory.index_landing import IndexLanding
from kv_service.memory.store import allocate_local
from tests.service_harness import TINY

LAYOUT = KVLayout(**{**TINY.to_dict(), "num_pages": 32})
PROMPT = list(range(100, 130))  # 30 tokens: 7 full pages and 2 tokens of an eighth


def _core() -> tuple[ServiceCore, IndexLanding, str]:
    kv = allocate_local(LAYOUT)
    core = ServiceCore(kv, lease_seconds=5.0, epoch=7)
    # What memory/transfer_agent.kv_agent does on a GPU (there the mirror is pinned host memory).
    core.ledger.key_landing = landing = IndexLanding(kv.index_pool, torch.zeros_like(kv.index_pool))
    return core, landing, core.attach("eng", fingerprint="model-a").session_id


def _mark(t: torch.Tensor, pages: list[int], value: int) -> None:
    t[:, pages] = value


def test_prefilled_moves_exactly_the_private_pages_keys() -> None:
    core, landing, sid = _core()
    pool, mirror = landing.pool, landing.mirror
    names = page_hashes(PROMPT, LAYOUT.page_size)
    first = core.admit(sid, "a", len(PROMPT), 2, names)
    core.commit(sid, "a", len(PROMPT))  # publishes its 7 full pages
    _mark(pool, first.pages, 5)  # the cached pages' keys, as its own prefill wrote them
    # 33 prompt tokens (9 pages, 7 of them cached) and room for 8 more (2 pages not yet used).
    second = core.admit(sid, "b", len(PROMPT) + 3, 8, page_hashes(PROMPT + [1, 2, 3], 4))
    assert second.cached_tokens == 28 and len(second.pages) == 11
    mirror.fill_(9)  # what the mirror holds elsewhere: other requests' keys, stale ones
    _mark(mirror, second.pages[7:], 7)
    core.prefilled(sid, "b", len(PROMPT) + 3)
    assert (pool[:, second.pages[7:9]] == 7).all()
    assert (pool[:, second.pages[:7]] == 5).all(), "a shared page's keys were overwritten"
    untouched = set(range(LAYOUT.num_pages)) - set(first.pages) - set(second.pages[:9])
    assert (pool[:, sorted(untouched)] == 0).all()
    assert (pool[:, [p for p in first.pages if p not in second.pages]] == 5).all()


def test_without_a_landing_prefilled_copies_nothing() -> None:
    kv = allocate_local(LAYOUT)
    core = ServiceCore(kv, lease_seconds=5.0, epoch=7)
    sid = core.attach("eng").session_id
    core.admit(sid, "a", len(PROMPT), 2)
    core.prefilled(sid, "a", len(PROMPT))
    assert (kv.index_pool == 0).all()


def test_take_copies_runs_of_consecutive_pages_once_each() -> None:
    pool = torch.zeros(2, 10, 4, 3)
    mirror = torch.arange(pool.numel(), dtype=pool.dtype).view_as(pool)
    landing = IndexLanding(pool, mirror)
    assert landing.take([6, 2, 3, 4, 7]) == 2  # runs 2-4 and 6-7
    taken = [2, 3, 4, 6, 7]
    assert torch.equal(pool[:, taken], mirror[:, taken])
    assert (pool[:, [0, 1, 5, 8, 9]] == 0).all()


def test_a_bad_page_or_a_mislaid_mirror_is_refused() -> None:
    pool = torch.zeros(2, 10, 4, 3)
    landing = IndexLanding(pool, torch.zeros_like(pool))
    with pytest.raises(ValueError, match="outside"):
        landing.take([3, 10])
    assert (pool == 0).all()
    with pytest.raises(ValueError, match="laid out"):
        IndexLanding(pool, torch.zeros(2, 10, 3, 4))


@pytest.mark.gpu
def test_gpu_landing_is_a_pinned_mirror_whose_pages_reach_the_device_pool() -> None:
    """The GPU service's case: a device pool, its pinned host mirror made by the landing itself
    (what NIXL registers as DRAM), and `take` moving runs of pages with non-contiguous layer
    slices on both sides."""
    pool = torch.zeros(3, 12, 4, 132, dtype=torch.uint8, device="cuda")
    landing = IndexLanding(pool)
    assert landing.mirror.is_pinned() and landing.mirror.stride() == pool.stride()
    landing.mirror.copy_(torch.randint(0, 255, landing.mirror.shape, dtype=torch.uint8))
    assert landing.take([9, 1, 2, 10, 5]) == 3
    torch.cuda.current_stream().synchronize()
    taken = [1, 2, 5, 9, 10]
    assert torch.equal(pool[:, taken].cpu(), landing.mirror[:, taken])
    assert (pool[:, [0, 3, 4, 6, 7, 8, 11]] == 0).all()
