"""Which rows of a request the shared hot region may serve (`shared_len`, contract/
shared_region.py): exactly its cached prefix, the rows of shared read-only pages, whatever
wrote the rest of its prompt (its own prefill, or a prefill engine whose rows landed with
Prefilled: those are the request's own pages); none for a resident request or a freed slot."""

from __future__ import annotations

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.prefix import page_hashes
from kv_service.core import ServiceCore
from kv_service.memory.store import allocate_local
from tests.service_harness import TINY

# P = 4, B = 16, W = 4: 16 tokens or fewer are resident; one request slot's buffers hold the
# region, 3 request slots are left.
LAYOUT = KVLayout(**{**TINY.to_dict(), "num_pages": 32, "shared_slots": 16})
PROMPT = list(range(100, 130))  # 30 tokens: 7 full pages


def _core() -> tuple[ServiceCore, str]:
    core = ServiceCore(allocate_local(LAYOUT), lease_seconds=5.0, epoch=7)
    return core, core.attach("eng", fingerprint="model-a").session_id


def _names(tokens: list[int]) -> list[bytes]:
    return page_hashes(tokens, LAYOUT.page_size)


def _shared_len(core: ServiceCore, slot: int) -> int:
    assert core.kv is not None and core.kv.shared is not None
    return int(core.kv.shared.shared_len[slot])


def test_a_cached_prefix_is_shared_its_own_prefill_is_not() -> None:
    core, sid = _core()
    first = core.admit(sid, "a", len(PROMPT), 2, _names(PROMPT))
    assert first.mode == MODE_OFFLOADED and _shared_len(core, first.slot) == 0
    core.commit(sid, "a", len(PROMPT))  # its 7 full pages are published
    assert _shared_len(core, first.slot) == 0
    second = core.admit(sid, "b", len(PROMPT) + 3, 2, _names(PROMPT + [1, 2, 3]))
    assert second.cached_tokens == 28 and _shared_len(core, second.slot) == 28
    core.commit(sid, "b", len(PROMPT) + 3)  # its prefill after the cached prefix
    assert _shared_len(core, second.slot) == 28
    core.release(sid, "b")
    assert _shared_len(core, second.slot) == 0


def test_rows_landed_by_a_prefill_engine_are_not_shared() -> None:
    """Prefilled (disaggregation): the peer wrote the prompt past the cached prefix into the
    request's own pages; only the cached prefix may come from the region."""
    core, sid = _core()
    core.admit(sid, "a", len(PROMPT), 2, _names(PROMPT))
    core.commit(sid, "a", len(PROMPT))
    cached = core.admit(sid, "b", len(PROMPT) + 3, 2, _names(PROMPT + [1, 2, 3]))
    core.prefilled(sid, "b", len(PROMPT) + 3)
    assert _shared_len(core, cached.slot) == 28
    cold = core.admit(sid, "c", len(PROMPT), 2)  # no page names: nothing cached
    core.prefilled(sid, "c", len(PROMPT))
    assert _shared_len(core, cold.slot) == 0


def test_a_resident_request_reads_nothing_from_the_region() -> None:
    core, sid = _core()
    short = PROMPT[:12]
    core.admit(sid, "a", len(short), 2, _names(short))
    core.commit(sid, "a", len(short))
    again = core.admit(sid, "b", len(short), 2, _names(short))
    assert again.mode == MODE_RESIDENT and again.cached_tokens == 8
    assert _shared_len(core, again.slot) == 0
