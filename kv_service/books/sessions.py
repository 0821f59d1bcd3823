"""The sessions of one service core: attach, resume, leases and open streams.

A session's lease runs only while it has no open Session stream; once it expires the core frees
every request of the session (their page references included).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from contract import prefix
from contract.errors import CapacityError, InvalidArgument, UnknownSession
from contract.ids import MAX_ID_BYTES
from kv_service.books.records import SessionRecord, check_id

log = logging.getLogger(__name__)


def _check_names(engine_name: str, fingerprint: str) -> None:
    if len(engine_name.encode()) > MAX_ID_BYTES or not engine_name.isprintable():
        raise InvalidArgument(f"engine_name must be <= {MAX_ID_BYTES} bytes of printable text")
    if len(fingerprint.encode()) > prefix.MAX_FINGERPRINT_BYTES or not fingerprint.isprintable():
        raise InvalidArgument(
            f"model_fingerprint must be <= {prefix.MAX_FINGERPRINT_BYTES} bytes of printable text"
        )


class SessionTable:
    """Live sessions by id."""

    def __init__(self, lease_seconds: float, max_sessions: int, clock: Callable[[], float]):
        self.lease_seconds, self.max_sessions, self._clock = lease_seconds, max_sessions, clock
        self.sessions: dict[str, SessionRecord] = {}

    def open(self, engine_name: str, fingerprint: str) -> SessionRecord:
        """A new session. `fingerprint` names the engine's model and weights: only sessions
        with one use the prefix cache, and only pages of the same fingerprint are shared."""
        _check_names(engine_name, fingerprint)
        if len(self.sessions) >= self.max_sessions:
            raise CapacityError(
                "too many sessions",
                sessions_needed=1,
                sessions_free=0,
                sessions_total=self.max_sessions,
            )
        session = SessionRecord(
            secrets.token_hex(16), engine_name, self._clock(), fingerprint=fingerprint
        )
        self.sessions[session.session_id] = session
        log.info("session %s attached by %r", session.session_id, engine_name)
        return session

    def resume(self, session_id: str, engine_name: str, fingerprint: str) -> SessionRecord:
        """The live session `session_id`, with its requests, for a restarted engine."""
        _check_names(engine_name, fingerprint)
        session = self.get(session_id)
        if fingerprint != session.fingerprint:
            # Its requests hold pages named in the old model's namespace.
            raise InvalidArgument(
                "resuming a session with another model fingerprint",
                expected=session.fingerprint,
                got=fingerprint,
            )
        session.last_seen = self._clock()
        log.info(
            "session %s resumed by %r with %d requests",
            session.session_id,
            engine_name,
            len(session.requests),
        )
        return session

    def get(self, session_id: str) -> SessionRecord:
        check_id("session_id", session_id)
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(
                f"no session {session_id!r} (never attached, detached or lease expired)",
                session_id=session_id,
            )
        return session

    def touch(self, session_id: str) -> SessionRecord:
        session = self.get(session_id)
        session.last_seen = self._clock()
        return session

    def stream_opened(self, session_id: str) -> None:
        self.touch(session_id).streams += 1

    def stream_closed(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.streams = max(0, session.streams - 1)
            session.last_seen = self._clock()

    def expired(self) -> list[SessionRecord]:
        """Sessions without an open stream whose lease ran out."""
        now = self._clock()
        return [
            s
            for s in self.sessions.values()
            if s.streams == 0 and now - s.last_seen > self.lease_seconds
        ]
