"""Prefix sharing in the service core (in-process, CPU tensors): admission with a cached prefix,
publication, namespaces, the rows a cached prefix puts in the hot buffer, capacity, leases,
release of generated pages, flush."""

from __future__ import annotations

import pytest
import torch

from contract.errors import CapacityError, InvalidArgument
from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.prefix import page_hashes
from kv_service.core import ServiceCore
from kv_service.memory.store import allocate_local
from tests.kv_service.test_core import Clock
from tests.service_harness import TINY

# P = 4, B = 16, W = 4 (16 tokens or fewer are resident), 24 pages.
LAYOUT = KVLayout(**{**TINY.to_dict(), "num_pages": 24})
PROMPT = list(range(100, 130))  # 30 tokens: 7 full pages


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(clock: Clock) -> ServiceCore:
    return ServiceCore(allocate_local(LAYOUT), lease_seconds=5.0, epoch=7, clock=clock)


def names(tokens: list[int]) -> list[bytes]:
    return page_hashes(tokens, LAYOUT.page_size)


def written(core: ServiceCore, sid: str, rid: str, tokens: list[int], **kw):
    """Admit `tokens` as a prompt, write recognisable rows for the uncached part (host tier,
    index keys, and hot slots as the append kernel would) and commit the whole prompt."""
    r = core.admit(sid, rid, len(tokens), kw.pop("new", 2), names(tokens), **kw)
    kv, P = core.kv, LAYOUT.page_size
    for t in range(r.cached_tokens, len(tokens)):
        page, row = r.pages[t // P], torch.full((LAYOUT.row_bytes,), tokens[t] % 251)
        kv.index_pool[:, page, t % P] = tokens[t] % 251
        if r.mode == MODE_RESIDENT:
            kv.hot_kv[:, r.slot, t] = row
        else:
            kv.host_kv[page, :, t % P] = row
    core.commit(sid, rid, len(tokens))
    return r


def test_second_request_maps_the_cached_prefix_and_prefills_the_rest(core: ServiceCore) -> None:
    sid = core.attach("eng", fingerprint="model-a").session_id
    first = written(core, sid, "a", PROMPT)
    assert first.cached_tokens == 0 and first.mode == MODE_OFFLOADED
    assert core.stats().cached_pages == 7
    second = core.admit(sid, "b", len(PROMPT) + 3, 2, names(PROMPT + [1, 2, 3]))
    # 8 full pages named; 7 cached; the last prompt token is always computed.
    assert second.cached_tokens == 28 and second.pages[:7] == first.pages[:7]
    assert not set(second.pages[7:]) & set(first.pages)
    assert core.kv.page_table[second.slot, :7].tolist() == first.pages[:7]
    s = core.stats()
    # Shared pages count once: 8 + (9 - 7) pages for 2 requests.
    assert s.pages_used == 8 + 2 and s.prefix_lookups_total == 2
    assert (s.prefix_hit_tokens_total, s.prefix_lookup_tokens_total) == (28, 30 + 33)
    # A prompt that is all cached still computes its last token: one page less is reused.
    third = core.admit(sid, "c", 28, 1, names(PROMPT[:28]))
    assert third.cached_tokens == 24
    core.check()


def test_reuse_is_aligned_to_the_engines_prefill_chunk(core: ServiceCore) -> None:
    sid = core.attach("eng", fingerprint="m").session_id
    written(core, sid, "a", PROMPT)
    # lcm(P = 4, align) tokens: 8 -> 24 of 28, 12 -> 24, 6 -> lcm 12 -> 24, 32 -> 0.
    for align, cached in ((8, 24), (12, 24), (6, 24), (32, 0), (0, 28), (1, 28)):
        assert core.admit(sid, "b", 30, 1, names(PROMPT), align=align).cached_tokens == cached
        core.release(sid, "b")
    core.check()


def test_namespace_or_salt_mismatch_never_shares(core: ServiceCore) -> None:
    a = core.attach("eng", fingerprint="model-a").session_id
    b = core.attach("eng2", fingerprint="model-b").session_id
    a2 = core.attach("eng3", fingerprint="model-a").session_id
    written(core, a, "x", PROMPT)

    def cached(sid: str, tokens: list[int], salt: str = "") -> int:
        got = core.admit(sid, "probe", len(tokens), 1, names(tokens), salt=salt).cached_tokens
        core.release(sid, "probe")
        return got

    assert cached(b, PROMPT) == 0 and cached(a, PROMPT, "tenant") == 0
    # The same model in another session shares; a salted prompt shares with its own salt.
    assert cached(a2, PROMPT) == 28
    written(core, a, "s", PROMPT[:12], salt="tenant")
    assert cached(a2, PROMPT[:13], "tenant") == 12 and cached(a2, PROMPT[:13], "other") == 0
    core.check()


def test_page_hashes_need_a_fingerprint_and_valid_sizes(core: ServiceCore) -> None:
    plain = core.attach("eng").session_id
    with pytest.raises(InvalidArgument, match="fingerprint"):
        core.admit(plain, "a", 30, 1, names(PROMPT))
    assert core.admit(plain, "a", 30, 1).cached_tokens == 0  # no names: no cache
    sid = core.attach("eng", fingerprint="m").session_id
    with pytest.raises(InvalidArgument):
        core.admit(sid, "b", 30, 1, names(PROMPT) + [b"x" * 16])  # more names than pages
    with pytest.raises(InvalidArgument):
        core.admit(sid, "b", 30, 1, [b"short"])
    with pytest.raises(InvalidArgument):
        core.admit(sid, "b", 30, 1, names(PROMPT), salt="s" * 200)
    with pytest.raises(InvalidArgument):
        core.attach("eng", fingerprint="\n")
    assert len(core.table.sessions[sid].requests) == 0
    core.check()


def test_cached_rows_land_in_the_hot_slots_a_request_keeps_them_in(core: ServiceCore) -> None:
    sid = core.attach("eng", fingerprint="m").session_id
    tokens = PROMPT[:14]
    first = written(core, sid, "a", tokens)  # resident: 14 + 2 <= 16
    assert first.mode == MODE_RESIDENT
    kv = core.kv
    # Publication copied the resident rows into the host tier (3 full pages).
    for t in range(12):
        assert (kv.host_kv[first.pages[t // 4], :, t % 4] == tokens[t] % 251).all(), t
    resident = core.admit(sid, "b", 14, 1, names(tokens))
    assert resident.cached_tokens == 12 and resident.mode == MODE_RESIDENT
    for t in range(12):
        assert (kv.hot_kv[:, resident.slot, t] == tokens[t] % 251).all(), t
    # An offloaded request keeps the newest W cached tokens in its window ring.
    long = core.admit(sid, "c", 14, 20, names(tokens))
    assert long.mode == MODE_OFFLOADED and long.cached_tokens == 12
    for t in range(8, 12):
        assert (kv.hot_kv[:, long.slot, t % 4] == tokens[t] % 251).all(), t
    core.check()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cached_rows_are_the_host_tiers_rows_on_either_device(device: str) -> None:
    """The rows an admission loads are byte for byte those of the host tier: on GPU the miss-copy
    kernel reads them from the pinned host tier (no pageable staging), on CPU a gather."""
    kv = allocate_local(LAYOUT, device)
    core = ServiceCore(kv, lease_seconds=5.0, epoch=7)
    sid = core.attach("eng", fingerprint="m").session_id
    tokens = PROMPT[:14]
    core.admit(sid, "a", len(tokens), 2, names(tokens))
    gen = torch.Generator().manual_seed(3)
    kv.host_kv.copy_(torch.randint(0, 256, kv.host_kv.shape, dtype=torch.uint8, generator=gen))
    core.commit(sid, "a", len(tokens))  # publishes 3 pages: a resident request's copied out
    core.rows.sync()  # that copy is asynchronous on GPU: done before the host rows change
    kv.host_kv.copy_(torch.randint(0, 256, kv.host_kv.shape, dtype=torch.uint8, generator=gen))
    host, P = kv.host_kv.cpu(), LAYOUT.page_size
    for rid, new, low in (("b", 1, 0), ("c", 20, 8)):  # resident: all 12; offloaded: the ring
        r = core.admit(sid, rid, len(tokens), new, names(tokens))
        assert r.cached_tokens == 12
        hot = kv.hot_kv[:, r.slot].cpu()
        for t in range(low, 12):
            want = host[r.pages[t // P], :, t % P]
            assert torch.equal(hot[:, t if low == 0 else t % LAYOUT.window], want), (rid, t)
    core.check()


def test_release_publishes_generated_pages_within_the_stored_length(core: ServiceCore) -> None:
    sid = core.attach("eng", fingerprint="m").session_id
    prompt, answer = PROMPT[:10], [7, 8, 9, 10, 11, 12, 13, 14, 15]
    r = written(core, sid, "a", prompt, new=12)
    core.step_end(sid, [("a", 18)], 0, 0, 0)  # 8 generated tokens stored
    conversation = prompt + answer  # 19 tokens known to the engine, 18 stored
    with pytest.raises(InvalidArgument, match="differ"):
        core.release(sid, "a", names([0] + conversation[1:]))
    core.release(sid, "a", names(conversation))
    # Pages 0-3 (tokens < 16) are shareable now; page 4 (tokens 16-19) was not fully stored.
    assert core.stats().cached_pages == 4 and core.holds_only_cache()
    turn2 = conversation + [50, 51, 52, 53, 54]
    nxt = core.admit(sid, "b", len(turn2), 4, names(turn2))
    assert nxt.cached_tokens == 16 and nxt.pages[:4] == r.pages[:4]
    core.check()


def test_eviction_before_refusal_and_exact_reservations(core: ServiceCore) -> None:
    sid = core.attach("eng", fingerprint="m").session_id
    written(core, sid, "a", PROMPT, new=0)  # 8 pages, 7 published
    core.release(sid, "a")
    assert core.holds_only_cache() and core.stats().evictable_pages == 7
    # 17 free + 7 evictable: a 20-page request evicts 3 (least recently used first).
    big = core.admit(sid, "big", 60, 4)  # 16 pages
    assert core.stats().evicted_pages_total == 0
    other = core.admit(sid, "o", 16, 0)  # 4 pages: 1 free + 3 evicted
    assert core.stats().evicted_pages_total == 3 and core.stats().cached_pages == 4
    with pytest.raises(CapacityError) as err:
        core.admit(sid, "no", 20, 0)  # 5 pages; 4 evictable, 0 free
    assert err.value.details["pages_evictable"] == "4" and not err.value.permanent
    # The surviving head of the chain still serves a prefix (in the room "o" leaves).
    core.release(sid, "o")
    hit = core.admit(sid, "hit", 30, 0, names(PROMPT))
    assert hit.cached_tokens == 16 and core.pages.free == 0
    for rid in ("big", "hit"):
        core.release(sid, rid)
    assert core.holds_only_cache()
    del big, other
    core.check()


def test_lease_expiry_releases_references_and_resume_keeps_them(
    core: ServiceCore, clock: Clock
) -> None:
    sid = core.attach("eng", fingerprint="m").session_id
    written(core, sid, "a", PROMPT)
    reader = core.attach("eng2", fingerprint="m").session_id
    core.admit(reader, "b", 30, 2, names(PROMPT))
    with pytest.raises(InvalidArgument):
        core.attach("eng2", reader, fingerprint="other-model")
    clock.now += 4
    assert core.attach("eng2", reader, fingerprint="m").requests["b"].cached_tokens == 28
    clock.now += 4  # the first session (no stream) expires, the resumed one does not
    assert core.expire_leases() == [sid]
    core.check()
    assert core.ledger.cache.refs(core.table.sessions[reader].requests["b"].pages[0]) == 1
    clock.now += 6
    assert core.expire_leases() == [reader]
    assert core.holds_only_cache() and core.stats().cached_pages == 7
    core.check()
    assert core.flush() == (7, 0) and core.is_empty()


def test_flush_with_requests_in_flight_then_empty(core: ServiceCore) -> None:
    sid = core.attach("eng", fingerprint="m").session_id
    written(core, sid, "a", PROMPT)
    b = core.admit(sid, "b", 30, 2, names(PROMPT))
    core.release(sid, "a")
    assert core.flush() == (0, 7)  # every cached page is in use by b: none freed, 7 unshared
    assert core.admit(sid, "c", 30, 2, names(PROMPT)).cached_tokens == 0
    core.release(sid, "b")
    core.release(sid, "c")
    assert core.is_empty()
    del b
