"""ServiceCore: sessions, admission, leases and per-request bookkeeping, without gRPC.

The gRPC servicer is a thin translation onto this class, and an engine in "embedded" mode calls it
in-process. It is not thread-safe: the service calls it from its event loop only.

Requests belong to the session that admitted them and are keyed by (session, request id), so a
session can never see or touch another session's requests: they are simply not found.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from contract.layout import MAX_ROWS_PER_STEP, MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.tensors import KVTensors
from kv_service import memory
from kv_service.errors import (
    AlreadyExists,
    CapacityError,
    Draining,
    EpochMismatch,
    InvalidArgument,
    UnknownRequest,
    UnknownSession,
)
from kv_service.pool import PagePool, SlotPool, reserve

log = logging.getLogger(__name__)

MAX_ID_BYTES = 128


@dataclass
class RequestRecord:
    request_id: str
    slot: int
    mode: int
    pages: list[int]
    prompt_len: int
    max_new_tokens: int
    seq_len: int = 0

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclass
class SessionRecord:
    session_id: str
    engine_name: str
    last_seen: float
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    # Open Session streams; the lease runs only while there are none.
    streams: int = 0


@dataclass(frozen=True)
class CoreStats:
    pages_used: int
    pages_total: int
    offloaded_pages_used: int
    slots_used: int
    slots_total: int
    sessions: int
    requests: int
    hits: int
    misses: int
    bytes_moved: int
    admitted_total: int
    rejected_total: int
    expired_sessions_total: int
    draining: bool
    uptime_seconds: float
    epoch: int


# Lengths beyond any layout's max_context; larger values are malformed, not merely too big.
MAX_TOKENS = 2**40


def check_id(name: str, value: str) -> None:
    size = len(value.encode())
    if not 1 <= size <= MAX_ID_BYTES or not value.isprintable():
        raise InvalidArgument(
            f"{name} must be 1..{MAX_ID_BYTES} bytes of printable text", field=name, length=size
        )


def check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(
            f"{name} = {value} is outside [{low}, {high}]",
            field=name,
            value=value,
            min=low,
            max=high,
        )


class ServiceCore:
    """Owns the pools and the bookkeeping of one KVTensors set."""

    def __init__(
        self,
        kv: KVTensors,
        *,
        lease_seconds: float,
        epoch: int | None = None,
        max_sessions: int = 64,
        clock: Callable[[], float] = time.monotonic,
        on_session_closed: Callable[[str], None] | None = None,
    ) -> None:
        self.kv = kv
        self.layout: KVLayout = kv.layout
        self.lease_seconds = lease_seconds
        self.epoch = epoch if epoch is not None else secrets.randbits(63) + 1
        self.max_sessions = max_sessions
        self._clock = clock
        self._started = clock()
        self._on_session_closed = on_session_closed
        self.pages = PagePool(self.layout.num_pages)
        self.slots = SlotPool(self.layout.max_requests)
        self.sessions: dict[str, SessionRecord] = {}
        self.draining = False
        self._counters = dict(
            hits=0,
            misses=0,
            bytes_moved=0,
            admitted_total=0,
            rejected_total=0,
            expired_sessions_total=0,
        )

    # --- sessions ---

    def attach(
        self, engine_name: str, resume_session_id: str = "", expected_layout: KVLayout | None = None
    ) -> SessionRecord:
        """A new session, or the live session `resume_session_id` with its requests."""
        if expected_layout is not None:
            self.layout.check_matches(expected_layout)
        if len(engine_name.encode()) > MAX_ID_BYTES or not engine_name.isprintable():
            raise InvalidArgument(f"engine_name must be <= {MAX_ID_BYTES} bytes of printable text")
        if resume_session_id:
            session = self.session(resume_session_id)
            session.last_seen = self._clock()
            log.info(
                "session %s resumed by %r with %d requests",
                session.session_id,
                engine_name,
                len(session.requests),
            )
            return session
        if len(self.sessions) >= self.max_sessions:
            raise CapacityError(
                "too many sessions",
                sessions_needed=1,
                sessions_free=0,
                sessions_total=self.max_sessions,
            )
        session = SessionRecord(secrets.token_hex(16), engine_name, self._clock())
        self.sessions[session.session_id] = session
        log.info("session %s attached by %r", session.session_id, engine_name)
        return session

    def session(self, session_id: str) -> SessionRecord:
        check_id("session_id", session_id)
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(
                f"no session {session_id!r} (never attached, detached or lease expired)",
                session_id=session_id,
            )
        return session

    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise EpochMismatch(
                "epoch does not match this service run: re-attach and remap memory",
                expected=self.epoch,
                got=epoch,
            )

    def touch(self, session_id: str) -> SessionRecord:
        session = self.session(session_id)
        session.last_seen = self._clock()
        return session

    def stream_opened(self, session_id: str) -> None:
        self.touch(session_id).streams += 1

    def stream_closed(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.streams = max(0, session.streams - 1)
            session.last_seen = self._clock()

    def detach(self, session_id: str) -> None:
        """End a session now and free all its requests."""
        self._close(self.session(session_id), "detached")

    def expire_leases(self) -> list[str]:
        """Close every session without an open stream whose lease ran out; returns their ids."""
        now = self._clock()
        expired = [
            s
            for s in self.sessions.values()
            if s.streams == 0 and now - s.last_seen > self.lease_seconds
        ]
        for session in expired:
            self._counters["expired_sessions_total"] += 1
            self._close(session, f"lease expired after {self.lease_seconds:g}s")
        return [s.session_id for s in expired]

    def _close(self, session: SessionRecord, why: str) -> None:
        for request in list(session.requests.values()):
            self._free(session, request)
        del self.sessions[session.session_id]
        log.info("session %s closed: %s", session.session_id, why)
        if self._on_session_closed is not None:
            self._on_session_closed(session.session_id)

    # --- requests ---

    def admit(
        self, session_id: str, request_id: str, prompt_len: int, max_new_tokens: int
    ) -> RequestRecord:
        """Reserve a slot and pages for prompt_len + max_new_tokens: decode can never run the
        host tier out of pages later."""
        session = self.touch(session_id)
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
        tokens = prompt_len + max_new_tokens
        try:
            slot, pages = reserve(self.pages, self.slots, self.layout.pages_for(tokens))
        except CapacityError:
            self._counters["rejected_total"] += 1
            raise
        mode = MODE_RESIDENT if tokens <= self.layout.hot_slots else MODE_OFFLOADED
        memory.reset_request(self.kv, slot, mode, pages)
        self._publish()
        request = RequestRecord(request_id, slot, mode, pages, prompt_len, max_new_tokens)
        session.requests[request_id] = request
        self._counters["admitted_total"] += 1
        return request

    def check_fits(self, tokens: int) -> None:
        """Refuse at once, as permanent, a request that would not fit even on an empty service:
        queueing it could only end in a timeout, and block smaller requests meanwhile."""
        lay = self.layout
        pages = -(-tokens // lay.page_size)
        if tokens > lay.max_context or pages > self.pages.total:
            self._counters["rejected_total"] += 1
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
        request = self.session(session_id).requests.get(request_id)
        if request is None:
            raise UnknownRequest(
                f"no request {request_id!r} in this session", request_id=request_id
            )
        return request

    def commit(self, session_id: str, request_id: str, seq_len: int) -> None:
        self.touch(session_id)
        request = self.request(session_id, request_id)
        check_range("seq_len", seq_len, 0, request.reserved_tokens)
        request.seq_len = seq_len

    def step_end(
        self,
        session_id: str,
        progress: Iterable[tuple[str, int]],
        hits: int,
        misses: int,
        bytes_moved: int,
    ) -> None:
        """Commit every (request id, seq_len) and add the step's counters. All or nothing: one bad
        entry changes nothing."""
        self.touch(session_id)
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
            check_range("seq_len", seq_len, 0, request.reserved_tokens)
            if request_id in updates:
                raise InvalidArgument(f"request {request_id!r} listed twice", request_id=request_id)
            updates[request_id] = (request, seq_len)
        self.add_counters(hits, misses, bytes_moved)
        for request, seq_len in updates.values():
            request.seq_len = seq_len

    def add_counters(self, hits: int, misses: int, bytes_moved: int) -> None:
        """Add one step's counters, refusing what no step can do: every layer of every request
        slot selects at most topk positions per row, a step has at most MAX_ROWS_PER_STEP rows
        per (layer, request) (a speculative step's verify and draft rows), and each miss moves
        at most one KV row and one index key. Totals are Python ints; `stats` readers clamp
        them to their field."""
        lay = self.layout
        positions = lay.num_layers * lay.topk * lay.max_requests * MAX_ROWS_PER_STEP
        check_range("hits", hits, 0, positions)
        check_range("misses", misses, 0, positions - hits)
        check_range("bytes_moved", bytes_moved, 0, positions * (lay.row_bytes + lay.index_bytes))
        for name, value in (("hits", hits), ("misses", misses), ("bytes_moved", bytes_moved)):
            self._counters[name] += value

    def release(self, session_id: str, request_id: str) -> None:
        session = self.touch(session_id)
        self._free(session, self.request(session_id, request_id))

    def _free(self, session: SessionRecord, request: RequestRecord) -> None:
        memory.free_request(self.kv, request.slot)
        self.pages.give_back(request.pages)
        self.slots.give_back([request.slot])
        del session.requests[request.request_id]

    def _publish(self) -> None:
        # Another process reads these tensors as soon as it gets our reply: the writes must have
        # landed in device memory before we answer.
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()

    # --- service state ---

    def start_drain(self) -> None:
        if not self.draining:
            log.info("draining: %d requests in flight", self.num_requests)
        self.draining = True

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions.values())

    def is_empty(self) -> bool:
        """No request left and both pools back to all-free."""
        return self.num_requests == 0 and self.pages.is_empty() and self.slots.is_empty()

    def stats(self) -> CoreStats:
        offloaded = sum(
            len(r.pages)
            for s in self.sessions.values()
            for r in s.requests.values()
            if r.mode == MODE_OFFLOADED
        )
        return CoreStats(
            pages_used=self.pages.used,
            pages_total=self.pages.total,
            offloaded_pages_used=offloaded,
            slots_used=self.slots.used,
            slots_total=self.slots.total,
            sessions=len(self.sessions),
            requests=self.num_requests,
            draining=self.draining,
            uptime_seconds=self._clock() - self._started,
            epoch=self.epoch,
            **self._counters,
        )
