"""The prefix cache's bookkeeping, plain Python: reference counts, LRU eviction before refusal,
flush, and its invariants under random operations; and the page names of contract.prefix."""

from __future__ import annotations

import random

import pytest

from contract.errors import CapacityError
from contract.prefix import PAGE_HASH_BYTES, namespace, page_hashes, scoped
from kv_service.books.pool import PagePool
from kv_service.books.prefix_cache import PrefixCache


def key(i: int) -> bytes:
    return i.to_bytes(PAGE_HASH_BYTES, "little")


def test_page_names_chain_the_prefix() -> None:
    a = page_hashes(list(range(10)), 4)
    assert len(a) == 2 and all(len(h) == PAGE_HASH_BYTES for h in a)  # partial page: no name
    assert page_hashes(list(range(8)) + [99, 98], 4) == a  # same full pages
    b = page_hashes([0, 1, 2, 3, 4, 5, 6, 99], 4)
    assert b[0] == a[0] and b[1] != a[1]
    # A page's name depends on everything before it, not only on its own tokens.
    c = page_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert c[1] != a[1]
    assert page_hashes(list(range(3)), 4) == []


def test_namespaces_separate_models_and_salts() -> None:
    names = page_hashes(list(range(8)), 4)
    spaces = [namespace("m1"), namespace("m2"), namespace("m1", "alice"), namespace("m1a", "lice")]
    keys = [tuple(scoped(ns, names)) for ns in spaces]
    assert len(set(keys)) == len(keys)
    assert scoped(namespace("m1"), names) == list(keys[0])


def test_take_publish_release_and_hit() -> None:
    cache = PrefixCache(PagePool(8))
    a = cache.take([], 3)
    assert a == [0, 1, 2] and all(cache.refs(p) == 1 for p in a)
    assert cache.publish(a[0], key(1)) and cache.publish(a[1], key(2))
    assert not cache.publish(a[2], key(1))  # another page holds the key: stays private
    assert cache.match([key(1), key(2), key(3)]) == [0, 1]
    b = cache.take([0, 1], 2)
    assert cache.refs(0) == 2 and b == [3, 4]
    cache.check([a, [0, 1] + b])
    cache.release(a)
    assert cache.pages.used == 4 and cache.refs(2) == 0  # page 2 was private: freed
    cache.release([0, 1] + b)
    assert (cache.cached, cache.evictable, cache.in_use, cache.pages.used) == (2, 2, 0, 2)
    cache.check([])
    # An unreferenced cached page is taken back out of the LRU by a hit.
    cache.take([0], 0)
    assert cache.evictable == 1 and cache.refs(0) == 1
    cache.check([[0]])


def test_eviction_before_refusal_in_lru_order_and_never_in_use() -> None:
    cache = PrefixCache(PagePool(6))
    first, second = cache.take([], 3), cache.take([], 3)
    for i, page in enumerate(first + second):
        cache.publish(page, key(i))
    cache.release(first)  # unreferenced: evictable, tail first
    assert cache.pages.free == 0 and cache.evictable == 3
    with pytest.raises(CapacityError) as err:
        cache.take([], 4)  # 3 evictable, second still in use
    assert err.value.details["pages_evictable"] == "3"
    assert cache.evictable == 3 and cache.evicted_total == 0  # a refusal changes nothing
    got = cache.take([], 2)
    # The chain's tail became unreferenced first, so it is evicted first; its head stays.
    assert sorted(got) == [1, 2] and cache.match([key(0)]) == [0] and cache.evicted_total == 2
    # Hits are not counted as evictable for the pages of the same admission.
    with pytest.raises(CapacityError):
        cache.take([0], 1)
    cache.check([second, got])


def test_flush_frees_unused_and_unshares_used() -> None:
    cache = PrefixCache(PagePool(4))
    a, b = cache.take([], 2), cache.take([], 1)
    for i, page in enumerate(a + b):
        cache.publish(page, key(i))
    cache.release(a)
    assert cache.flush() == 2 and cache.cached == 0 and cache.match([key(2)]) == []
    assert cache.pages.used == 1  # b still uses its page
    cache.release(b)
    assert cache.pages.is_empty()
    cache.check([])


def test_misuse_is_refused() -> None:
    cache = PrefixCache(PagePool(4))
    pages = cache.take([], 2)
    with pytest.raises(ValueError):
        cache.take([pages[0]], 0)  # not cached
    with pytest.raises(ValueError):
        cache.publish(3, key(0))  # not in use
    with pytest.raises(ValueError):
        cache.release(pages + pages)  # more releases than references
    assert cache.refs(pages[0]) == 1
    cache.check([pages])


def test_random_operations_keep_every_invariant() -> None:
    """Requests with random prompts from a few shared prefixes take, publish and release pages;
    after every step the reference counts equal the holders and no page is lost."""
    rng = random.Random(5)
    cache = PrefixCache(PagePool(40))
    held: dict[int, tuple[list[int], list[bytes]]] = {}
    for step in range(400):
        if held and (rng.random() < 0.45 or len(held) > 6):
            pages, keys = held.pop(rng.choice(list(held)))
            for page, k in zip(pages, keys):
                cache.publish(page, k)  # False for hits and duplicates
            cache.release(pages)
        else:
            base = rng.randrange(3)
            keys = [key(base * 100 + i) for i in range(rng.randrange(1, 8))]
            hits = cache.match(keys[: rng.randrange(len(keys) + 1)])
            try:
                fresh = cache.take(hits, len(keys) - len(hits) + rng.randrange(3))
            except CapacityError:
                cache.check([p for p, _ in held.values()])
                continue
            held[step] = (hits + fresh, keys)
        cache.check([p for p, _ in held.values()])
        assert cache.pages.used <= cache.pages.total
    for pages, _ in held.values():
        cache.release(pages)
    assert cache.pages.used == cache.evictable == cache.cached and cache.in_use == 0
    cache.flush()
    assert cache.pages.is_empty()
