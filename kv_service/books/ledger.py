"""The page ledger of one service core: request slots, pages and the prefix cache, and what
admission, publication, release and flush do to them (bookkeeping, plus the row moves they need
through a `RowStore`; no sessions, no transport).

Row stores: `kv_service.memory.store.TensorRows` (the service's KVTensors: host tier, hot buffers,
index pool) and the reference engine's baseline page table (its all-on-GPU cache), so the
baseline shares prefixes with the same bookkeeping.

Capacity rules:
- a request reserves pages for prompt + max_new_tokens at admission, so decode never runs the
  host tier out of pages; the pages of a cached prefix it reuses count once for all its users;
- its private pages cover every position it will write ([cached_tokens, reserved)), so no write
  ever lands in a shared page;
- unreferenced cached pages are evicted (LRU) before an admission is refused; pages in use never.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from contract import prefix
from contract.errors import CapacityError, InvalidArgument
from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from kv_service.books.pool import PagePool, SlotPool
from kv_service.books.prefix_cache import PrefixCache
from kv_service.books.records import RequestRecord, check_range

log = logging.getLogger(__name__)


class RowStore(Protocol):
    """Where the ledger's pages and request slots live."""

    layout: KVLayout

    def reset(self, slot: int, mode: int, pages: list[int]) -> None:
        """Point request slot `slot` at `pages` (token order), with `mode`, empty residency."""

    def load_prefix(self, slot: int, mode: int, pages: list[int], stored: int, cached: int) -> None:
        """Put the rows [0, stored) where the slot's reader expects them; [0, cached) are the
        cached prefix's (shared, read-only pages), the rest the request's own."""

    def store_pages(self, slot: int, mode: int, pages: list[int], indices: list[int]) -> None:
        """Make full pages `indices` hold their rows in the shared store before publication."""

    def free(self, slot: int) -> None: ...

    def sync(self) -> None:
        """Let every write land before another process or stream may read it."""


@dataclass(frozen=True)
class PrefixQuery:
    """The prefix part of an admission: the request's namespace, the scoped keys of the
    prompt's full pages, and the reuse granularity in tokens (the engine's prefill chunk, so
    that it prefills the same chunks whether or not a prefix was cached; 0 or 1: a page)."""

    namespace: bytes = b""
    keys: tuple[bytes, ...] = ()
    align: int = 0

    @classmethod
    def checked(
        cls,
        layout: KVLayout,
        fingerprint: str,
        prompt_len: int,
        hashes: Sequence[bytes],
        salt: str,
        align: int,
    ) -> PrefixQuery:
        """From an Admit's fields, each checked (InvalidArgument)."""
        check_range("reuse_align", align, 0, layout.max_context)
        ns = request_namespace(fingerprint, hashes, salt)
        return cls(ns, tuple(scoped_keys(ns, hashes, prompt_len // layout.page_size)), align)


def request_namespace(fingerprint: str, names: Sequence[bytes], salt: str) -> bytes:
    """The namespace of a request's page hashes: its session's fingerprint and its salt."""
    if len(salt.encode()) > prefix.MAX_SALT_BYTES:
        raise InvalidArgument(
            f"cache_salt must be <= {prefix.MAX_SALT_BYTES} bytes", length=len(salt.encode())
        )
    if names and not fingerprint:
        raise InvalidArgument(
            "page hashes need a model fingerprint: attach with model_fingerprint set"
        )
    return prefix.namespace(fingerprint, salt) if fingerprint else b""


def scoped_keys(namespace: bytes, names: Sequence[bytes], most: int) -> list[bytes]:
    """Page hashes checked (count, size) and scoped to their namespace: cache keys."""
    check_range("page_hashes", len(names), 0, most)
    bad = [i for i, n in enumerate(names) if len(n) != prefix.PAGE_HASH_BYTES]
    if bad:
        raise InvalidArgument(
            f"page hashes must have {prefix.PAGE_HASH_BYTES} bytes", first_bad_index=bad[0]
        )
    return prefix.scoped(namespace, names)


class KeyLanding(Protocol):
    """Where a GPU service's remote prefill writes put index keys
    (kv_service/memory/index_landing.py): `take` moves pages of them into the pool."""

    def take(self, pages: Sequence[int]) -> int: ...


class PageLedger:
    """Slots, pages and cached pages of one KVTensors set."""

    def __init__(self, rows: RowStore) -> None:
        self.rows, self.layout = rows, rows.layout
        # A GPU service with --nixl: memory/transfer_agent.kv_agent's (rpc/server.py sets it).
        self.key_landing: KeyLanding | None = None
        # A RowStore with a shared hot region (TensorRows) keeps some request slots for it and
        # hears of every page freed (its rows there must never hit again).
        self.pages = PagePool(self.layout.num_pages, on_free=getattr(rows, "forget_pages", None))
        self.slots = SlotPool(getattr(rows, "request_slots", self.layout.max_requests))
        self.cache = PrefixCache(self.pages)
        self.counters = dict(
            prefix_lookups_total=0, prefix_lookup_tokens_total=0, prefix_hit_tokens_total=0
        )

    def cached_prefix(self, prompt_len: int, query: PrefixQuery) -> list[int]:
        """The cached pages a prompt may reuse: the longest cached prefix of its keys, cut so
        that at least the last prompt token is computed (its logits start the generation) and
        to a multiple of lcm(page size, align) tokens."""
        P = self.layout.page_size
        grain = math.lcm(P, max(query.align, 1)) // P
        usable = min(len(query.keys), (prompt_len - 1) // P)
        hits = self.cache.match(query.keys[:usable])
        return hits[: len(hits) // grain * grain]

    def admit(
        self, request_id: str, prompt_len: int, max_new_tokens: int, query: PrefixQuery
    ) -> RequestRecord:
        """A slot, the cached prefix's pages and private pages for the rest of the reservation;
        the slot's tensors reset and its hot buffer loaded with the prefix's rows. All or
        nothing: a CapacityError changes nothing."""
        lay, tokens = self.layout, prompt_len + max_new_tokens
        hits = self.cached_prefix(prompt_len, query) if query.keys else []
        self._check_room(hits, lay.pages_for(tokens) - len(hits))
        fresh = self.cache.take(hits, lay.pages_for(tokens) - len(hits))
        slot, pages = self.slots.take_one(), hits + fresh
        cached = len(hits) * lay.page_size
        mode = MODE_RESIDENT if tokens <= lay.hot_slots else MODE_OFFLOADED
        self.rows.reset(slot, mode, pages)
        self.rows.load_prefix(slot, mode, pages, cached, cached)
        if query.keys:
            c = self.counters
            c["prefix_lookups_total"] += 1
            c["prefix_lookup_tokens_total"] += prompt_len
            c["prefix_hit_tokens_total"] += cached
        record = RequestRecord(request_id, slot, mode, pages, prompt_len, max_new_tokens)
        record.cached_tokens, record.keys, record.published = cached, list(query.keys), len(hits)
        record.namespace = query.namespace
        return record

    def learn(self, request: RequestRecord, hashes: Sequence[bytes]) -> None:
        """Names of every full page of a finished request's tokens (they must start with the
        admission's): its written pages not yet published are published now."""
        if not request.namespace:
            raise InvalidArgument("page hashes need a model fingerprint at attach")
        keys = scoped_keys(request.namespace, hashes, len(request.pages))
        known = len(request.keys)
        if keys[:known] != request.keys[: len(keys)]:
            raise InvalidArgument(
                "page hashes differ from those given at admission", request_id=request.request_id
            )
        if len(keys) > known:
            request.keys = keys
        self.publish(request)

    def _check_room(self, hits: list[int], fresh: int) -> None:
        """A CapacityError naming every shortage unless a slot and `fresh` pages are there."""
        room, free = self.cache.room(hits), self.pages.free
        if self.slots.free >= 1 and fresh <= room:
            return
        raise CapacityError(
            f"admission needs 1 slot and {fresh} pages; free: {self.slots.free} slots, "
            f"{free} pages and {room - free} evictable cached pages",
            pages_needed=fresh,
            pages_free=free,
            pages_evictable=room - free,
            pages_total=self.pages.total,
            slots_needed=1,
            slots_free=self.slots.free,
            slots_total=self.slots.total,
        )

    def publish(self, request: RequestRecord) -> int:
        """Publish the request's full pages whose rows are written (within seq_len) and whose
        keys are known; a resident request's pages get their host rows first. No sync: that
        copy is only enqueued, and the admission that maps the page syncs before it answers (a
        sync here would wait for the engine's step in flight in embedded mode). Returns how
        many pages were newly published."""
        P = self.layout.page_size
        end = min(len(request.keys), request.seq_len // P, len(request.pages))
        todo = list(range(request.published, end))
        if not todo:
            return 0
        self.rows.store_pages(request.slot, request.mode, request.pages, todo)
        request.published = end
        return sum(self.cache.publish(request.pages[i], request.keys[i]) for i in todo)

    def land(self, request: RequestRecord, seq_len: int) -> None:
        """Rows [cached_tokens, seq_len) were written into the request's pages from outside
        (disaggregated prefill): load them where its reader expects them, as a cached prefix
        is, then commit the length."""
        request.check_stored(seq_len, max(1, request.seq_len))
        self.rows.load_prefix(
            request.slot, request.mode, request.pages, seq_len, request.cached_tokens
        )
        if self.key_landing is not None:  # the writer's keys wait in host memory
            P = self.layout.page_size  # its private pages: the writer skips the shared ones
            self.key_landing.take(request.pages[request.cached_tokens // P : -(-seq_len // P)])
        request.seq_len = seq_len
        self.publish(request)

    def free(self, request: RequestRecord) -> None:
        self.rows.free(request.slot)
        self.cache.release(request.pages)
        self.slots.give_back([request.slot])

    def flush(self) -> tuple[int, int]:
        """(pages freed, cached pages in use that stop being shared)."""
        in_use = self.cache.cached - self.cache.evictable
        freed = self.cache.flush()
        log.info("prefix cache flushed: %d pages freed, %d in use unshared", freed, in_use)
        return freed, in_use

    def is_empty(self) -> bool:
        """Every page and slot free: nothing admitted and nothing cached."""
        return self.pages.is_empty() and self.slots.is_empty()

    def holds_only_cache(self) -> bool:
        """No request holds anything: every used page is an unreferenced cached page."""
        return (
            self.slots.is_empty()
            and self.cache.in_use == 0
            and self.pages.used == self.cache.evictable
        )
