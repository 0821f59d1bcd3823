"""ServiceCore: sessions, admission, leases and per-request bookkeeping, without gRPC.

The gRPC servicer is a thin translation onto this class, and an engine in "embedded" mode calls it
in-process. It is not thread-safe: the service calls it from its event loop only.

Requests belong to the session that admitted them and are keyed by (session, request id), so a
session can never see or touch another session's requests: they are simply not found.
One concept, the service's logic: each kvcache.v1 call on the books (`books/`) and memory.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence

from contract.errors import (
    AlreadyExists,
    CapacityError,
    Draining,
    EpochMismatch,
    InvalidArgument,
    UnknownRequest,
)
from contract.layout import MODE_OFFLOADED, KVLayout
from contract.tensors import KVTensors
from kv_service.books.ledger import PageLedger, PrefixQuery, RowStore
from kv_service.books.records import (
    MAX_TOKENS,
    CoreStats,
    RequestRecord,
    SessionRecord,
    Totals,
    check_id,
    check_range,
)
from kv_service.books.sessions import SessionTable
from kv_service.memory.store import TensorRows

log = logging.getLogger(__name__)

__all__ = ["CoreStats", "RequestRecord", "ServiceCore", "SessionRecord"]


class ServiceCore:
    """Owns the pools and the bookkeeping of one KVTensors set."""

    def __init__(
        self,
        kv: KVTensors | RowStore,
        *,
        lease_seconds: float,
        epoch: int | None = None,
        max_sessions: int = 64,
        clock: Callable[[], float] = time.monotonic,
        on_session_closed: Callable[[str], None] | None = None,
    ) -> None:
        # A KVTensors set (the service, embedded mode), or another RowStore (the reference
        # engine's baseline page table: its bookkeeping without the service's memory).
        self.kv = kv if isinstance(kv, KVTensors) else None
        self.rows: RowStore = TensorRows(kv) if isinstance(kv, KVTensors) else kv
        self.layout: KVLayout = kv.layout
        self.lease_seconds = lease_seconds
        self.epoch = epoch if epoch is not None else secrets.randbits(63) + 1
        self._clock = clock
        self._started = clock()
        self._on_session_closed = on_session_closed
        self.ledger = PageLedger(self.rows)
        self.pages, self.slots = self.ledger.pages, self.ledger.slots
        self.table = SessionTable(lease_seconds, max_sessions, clock)
        self.draining = False
        self.totals = Totals()

    # --- sessions ---

    def attach(
        self,
        engine_name: str,
        resume_session_id: str = "",
        expected_layout: KVLayout | None = None,
        fingerprint: str = "",
    ) -> SessionRecord:
        """A new session, or the live session `resume_session_id` with its requests.
        `fingerprint` names the model and weights (the prefix cache's namespace)."""
        if expected_layout is not None:
            self.layout.check_matches(expected_layout)
        if resume_session_id:
            return self.table.resume(resume_session_id, engine_name, fingerprint)
        return self.table.open(engine_name, fingerprint)

    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise EpochMismatch(
                "epoch does not match this service run: re-attach and remap memory",
                expected=self.epoch,
                got=epoch,
            )

    def detach(self, session_id: str) -> None:
        """End a session now and free all its requests."""
        self._close(self.table.get(session_id), "detached")

    def expire_leases(self) -> list[str]:
        """Close every session without an open stream whose lease ran out; returns their ids."""
        expired = self.table.expired()
        for session in expired:
            self.totals.expired_sessions_total += 1
            self._close(session, f"lease expired after {self.lease_seconds:g}s")
        return [s.session_id for s in expired]

    def _close(self, session: SessionRecord, why: str) -> None:
        for request in list(session.requests.values()):
            self._free(session, request)
        del self.table.sessions[session.session_id]
        log.info("session %s closed: %s", session.session_id, why)
        if self._on_session_closed is not None:
            self._on_session_closed(session.session_id)

    # --- requests ---

    def admit(
        self,
        session_id: str,
        request_id: str,
        prompt_len: int,
        max_new_tokens: int,
        page_hashes: Sequence[bytes] = (),
        salt: str = "",
        align: int = 0,
    ) -> RequestRecord:
        """Reserve a slot and pages for prompt_len + max_new_tokens: decode can never run the
        host tier out of pages later. `page_hashes` (contract.prefix.page_hashes of the prompt's
        full pages) look up a cached prefix and publish the prompt's pages once written; the
        record's cached_tokens says how much of the prompt the engine must not prefill."""
        session = self.table.touch(session_id)
        if self.draining:
            raise Draining("the service is draining and admits no new request")
        check_id("request_id", request_id)
        check_range("prompt_len", prompt_len, 1, MAX_TOKENS)
        check_range("max_new_tokens", max_new_tokens, 0, MAX_TOKENS)
        self.check_fits(prompt_len + max_new_tokens)
        if request_id in session.requests:
            raise AlreadyExists(
                f"request {request_id!r} is already admitted", request_id=request_id
            )
        query = PrefixQuery.checked(
            self.layout, session.fingerprint, prompt_len, page_hashes, salt, align
        )
        try:
            request = self.ledger.admit(request_id, prompt_len, max_new_tokens, query)
        except CapacityError:
            self.totals.rejected_total += 1
            raise
        # Another process reads these tensors as soon as it gets our reply: the writes (and
        # any page published before) must have landed before we answer.
        self.rows.sync()
        session.requests[request_id] = request
        self.totals.admitted_total += 1
        return request

    def check_fits(self, tokens: int) -> None:
        """Refuse at once, as permanent, a request that would not fit even on an empty service:
        queueing it could only end in a timeout, and block smaller requests meanwhile."""
        lay = self.layout
        pages = -(-tokens // lay.page_size)
        if tokens > lay.max_context or pages > self.pages.total:
            self.totals.rejected_total += 1
            raise CapacityError(
                f"{tokens} tokens can never fit: at most {lay.max_context} tokens per request "
                f"and {self.pages.total} pages of {lay.page_size} tokens in all",
                permanent=True,
                tokens_needed=tokens,
                tokens_total=lay.max_context,
                pages_needed=pages,
                pages_free=self.pages.free,
                pages_total=self.pages.total,
            )

    def request(self, session_id: str, request_id: str) -> RequestRecord:
        check_id("request_id", request_id)
        request = self.table.get(session_id).requests.get(request_id)
        if request is None:
            raise UnknownRequest(
                f"no request {request_id!r} in this session", request_id=request_id
            )
        return request

    def commit(self, session_id: str, request_id: str, seq_len: int) -> None:
        self.table.touch(session_id)
        request = self.request(session_id, request_id)
        request.check_stored(seq_len)
        request.seq_len = seq_len
        self.ledger.publish(request)  # its newly stored full pages become shareable

    def step_end(
        self,
        session_id: str,
        progress: Iterable[tuple[str, int]],
        hits: int,
        misses: int,
        bytes_moved: int,
        steps: int = 1,
    ) -> None:
        """Commit every (request id, seq_len) and add the counters of the `steps` steps the report
        merges. All or nothing: one bad entry changes nothing."""
        self.table.touch(session_id)
        progress = list(progress)
        if len(progress) > self.layout.max_requests:
            raise InvalidArgument(
                f"{len(progress)} progress entries, more than the "
                f"{self.layout.max_requests} request slots",
                entries=len(progress),
                max_entries=self.layout.max_requests,
            )
        updates: dict[str, tuple[RequestRecord, int]] = {}
        for request_id, seq_len in progress:
            request = self.request(session_id, request_id)
            request.check_stored(seq_len)
            if request_id in updates:
                raise InvalidArgument(f"request {request_id!r} listed twice", request_id=request_id)
            updates[request_id] = (request, seq_len)
        self.totals.add_step(self.layout, hits, misses, bytes_moved, steps)
        for request, seq_len in updates.values():
            request.seq_len = seq_len
            self.ledger.publish(request)

    def prefilled(self, session_id: str, request_id: str, seq_len: int) -> None:
        """Another process wrote the request's first seq_len rows into its pages (a prefill
        engine over NIXL): stored, and in the hot buffer where its reader expects them."""
        self.table.touch(session_id)
        self.ledger.land(self.request(session_id, request_id), seq_len)
        self.rows.sync()

    def release(self, session_id: str, request_id: str, page_hashes: Sequence[bytes] = ()) -> None:
        """Free a request. `page_hashes`: the names of every full page of its stored tokens
        (prompt and generated); those written and not yet published are published first, so a
        next turn of the conversation finds them. All or nothing: bad names free nothing."""
        session = self.table.touch(session_id)
        request = self.request(session_id, request_id)
        if page_hashes:
            self.ledger.learn(request, page_hashes)
        self._free(session, request)

    def _free(self, session: SessionRecord, request: RequestRecord) -> None:
        self.ledger.free(request)
        del session.requests[request.request_id]

    def flush(self) -> tuple[int, int]:
        """Drop every cached page no request uses; pages in use stop being shared and are
        freed with their last request. Returns (pages freed now, cached pages in use)."""
        return self.ledger.flush()

    # --- service state ---

    def start_drain(self) -> None:
        if not self.draining:
            log.info("draining: %d requests in flight", self.num_requests)
        self.draining = True

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.table.sessions.values())

    def is_empty(self) -> bool:
        """No request left and both pools back to all-free (nothing cached either)."""
        return self.num_requests == 0 and self.ledger.is_empty()

    def holds_only_cache(self) -> bool:
        """No request left; every page still used is an unreferenced cached page."""
        return self.num_requests == 0 and self.ledger.holds_only_cache()

    def check(self) -> None:
        """Every bookkeeping invariant, element by element (tests; O(pages))."""
        held = [r.pages for s in self.table.sessions.values() for r in s.requests.values()]
        self.ledger.cache.check(held)
        assert self.slots.used == len(held), "request slots leaked"

    def stats(self) -> CoreStats:
        requests = [r for s in self.table.sessions.values() for r in s.requests.values()]
        offloaded = {p for r in requests if r.mode == MODE_OFFLOADED for p in r.pages}  # once
        cache = self.ledger.cache
        return CoreStats(
            pages_used=self.pages.used,
            pages_total=self.pages.total,
            offloaded_pages_used=len(offloaded),
            slots_used=self.slots.used,
            slots_total=self.slots.total,
            sessions=len(self.table.sessions),
            requests=self.num_requests,
            draining=self.draining,
            uptime_seconds=self._clock() - self._started,
            epoch=self.epoch,
            cached_pages=cache.cached,
            evictable_pages=cache.evictable,
            evicted_pages_total=cache.evicted_total,
            **self.ledger.counters,
            **dataclasses.asdict(self.totals),
        )
