"""The engine's resume state (`serve --state-file PATH`): what a restarted engine needs to continue
the requests that the KV service still holds for its session.

The file is a JSON-lines log, mode 0600 (it holds prompts). Records are buffered and written
together, with one write() and flush per engine step, when the step's tokens are recorded:
before any of them is sent to a client, so a client never sees a token the file does not have.
A queued record is written at once, before its request id is handed to the client: every id a
client holds can be resumed.
  {"session": ID, "epoch": N}                       first line: the KV session to resume
  {"queued": RID, ...}                              a request queued, not admitted yet (the
                                                    fields of start); a restarted engine queues
                                                    it again
  {"start": RID, "prompt": [...], "max_new_tokens": N, "temperature": T, "seed": S, "stop": [...],
   "stop_strings": [...], "text": BOOL, "replayed": R, "cache_salt": SALT}
      (stop_strings, text, cache_salt: optional; R > 0: a revived request, see request.py)
  {"tokens": {RID: [new token ids], ...}}           one line per step
  {"end": RID}                                      the request finished and was released
  {"lost": RID}                                     the request failed with its KV service (its
                                                    KV is gone): kept, revived by a resume only
Sampling draws token i from a generator seeded by (seed, i), so prompt + tokens + seed are the
whole sampling state. A restart rewrites the file compactly (atomic rename).

A queued record of a revived request (R > 0) is followed by its tokens: a restarted engine queues
it again as revived, to prefill the prompt and those tokens. A lost request is written at a
rewrite as a queued record, its tokens and a lost record: a restarted engine keeps it finished
and revivable, as the engine that lost it did (engine_client.loop.finished), and does not run it
for a client that may have gone.

Durability: flushed to the OS, never fsynced. The file survives the engine process being killed
(the case resume exists for: the KV service keeps the KV for its lease), not the machine losing
power, which also loses the service's KV. A start record, and the end of an admitted request,
is buffered until the next step's write: a start lost with the process belongs to a request that
sent no token (the restarted engine releases it, and queues it again from its queued record); a
lost end only names a request the service no longer holds (it was released first). The end of a
request that never left the queue (cancelled, expired, refused) is written at once: its queued
record alone would make a restarted engine run it again for a client that went away.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from engine_client.loop.request import GenRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class SavedRequest:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    text: bool = False  # the request streams text: a resumed one gets a TextStream again
    replayed: int = 0  # a revived request's prefill re-creates the KV of its first R tokens
    queued: bool = False  # its id was handed out, it was not admitted (no start record)
    cache_salt: str = ""
    lost: bool = False  # failed with its KV service: revived by a resume, not run on its own


@dataclass
class SavedState:
    session_id: str = ""
    epoch: int = 0
    requests: dict[str, SavedRequest] = field(default_factory=dict)


def _start_record(r: GenRequest | SavedRequest) -> dict:
    s = r.sampling
    return {
        "start": r.request_id,
        "prompt": list(r.prompt),
        "max_new_tokens": r.max_new_tokens,
        "temperature": s.temperature,
        "seed": s.seed,
        "stop": list(s.stop_token_ids),
        "stop_strings": list(s.stop_strings),
        "text": r.text is not None if isinstance(r, GenRequest) else r.text,
        "replayed": r.replayed,
        "cache_salt": r.cache_salt,
    }


def _queued_record(r: GenRequest | SavedRequest) -> dict:
    rec = _start_record(r)
    rec["queued"] = rec.pop("start")
    return rec


def _records(r: GenRequest | SavedRequest, queued: bool) -> list[dict]:
    """A request's start (or queued) record, and its tokens if it has any (a revived request's,
    or a live one's in a rewrite)."""
    first = _queued_record(r) if queued else _start_record(r)
    return [first, {"tokens": {r.request_id: list(r.tokens)}}] if r.tokens else [first]


def _saved(rid: str, rec: dict, queued: bool) -> SavedRequest:
    sampling = SamplingParams(
        float(rec["temperature"]),
        int(rec["seed"]),
        tuple(int(t) for t in rec["stop"]),
        tuple(str(t) for t in rec.get("stop_strings", ())),
    )
    return SavedRequest(
        rid,
        tuple(rec["prompt"]),
        int(rec["max_new_tokens"]),
        sampling,
        text=bool(rec.get("text", False)),
        replayed=int(rec.get("replayed", 0)),
        queued=queued,
        cache_salt=str(rec.get("cache_salt", "")),
    )


def _apply(state: SavedState, rec: dict) -> None:
    if "session" in rec:
        state.session_id, state.epoch = rec["session"], int(rec["epoch"])
    elif "start" in rec:
        state.requests[rec["start"]] = _saved(rec["start"], rec, queued=False)
    elif "queued" in rec:
        state.requests[rec["queued"]] = _saved(rec["queued"], rec, queued=True)
    elif "tokens" in rec:
        for rid, toks in rec["tokens"].items():
            if rid in state.requests:
                state.requests[rid].tokens.extend(int(t) for t in toks)
    elif "end" in rec:
        state.requests.pop(rec["end"], None)
    elif "lost" in rec:
        if rec["lost"] in state.requests:
            state.requests[rec["lost"]].lost = True


def load(path: str) -> SavedState:
    """The state in `path`; empty if the file does not exist. A torn last line (the engine was
    killed mid-write) is ignored."""
    state = SavedState()
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return state
    for n, line in enumerate(lines, 1):
        try:
            _apply(state, json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s:%d: unreadable record ignored (%s)", path, n, e)
    return state


class StateFile:
    """Appends the engine's progress to `path`; see the module docstring for the format."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f: IO[str] | None = None
        self._buffer: list[str] = []

    def rewrite(
        self,
        session_id: str,
        epoch: int,
        live: list[GenRequest] | list[SavedRequest],
        queued: Sequence[GenRequest] = (),
        lost: Sequence[GenRequest] = (),
    ) -> None:
        """Start the file over: the session line, every live (admitted) request, every queued
        one and every lost one, compactly."""
        tmp = f"{self.path}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover of a killed engine, maybe with wider permissions
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps({"session": session_id, "epoch": epoch}) + "\n")
            for r in live:
                f.writelines(json.dumps(rec) + "\n" for rec in _records(r, queued=False))
            for q in queued:
                f.writelines(json.dumps(rec) + "\n" for rec in _records(q, queued=True))
            for r in lost:
                records = [*_records(r, queued=True), {"lost": r.request_id}]
                f.writelines(json.dumps(rec) + "\n" for rec in records)
        os.replace(tmp, self.path)
        self._buffer.clear()  # records of the file just replaced
        if self._f is not None:
            self._f.close()
        self._f = open(self.path, "a")
        log.info(
            "state file %s: session %s, %d live requests, %d lost",
            self.path,
            session_id,
            len(live),
            len(lost),
        )

    def _append(self, rec: dict) -> None:
        if self._f is None:
            raise RuntimeError("state file not started: call rewrite() first")
        self._buffer.append(json.dumps(rec, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        """Write every buffered record: one write() and flush."""
        if self._buffer and self._f is not None:
            self._f.write("".join(self._buffer))
            self._f.flush()
        self._buffer.clear()

    def queued(self, r: GenRequest) -> None:
        """A request queued, or revived and queued again: written at once (with the records
        buffered before it), since its id goes to the client next (or was held by one)."""
        for rec in _records(r, queued=True):
            self._append(rec)
        self.flush()

    def started(self, r: GenRequest) -> None:
        # A revived request carries its tokens: the file was started over when its KV was lost.
        for rec in _records(r, queued=False):
            self._append(rec)

    def tokens(self, new: dict[str, list[int]]) -> None:
        """A step's tokens: written at once, with the records buffered before them."""
        if new:
            self._append({"tokens": new})
        self.flush()

    def lost(self, request_id: str) -> None:
        """The request failed with its KV service: buffered (the caller flushes)."""
        self._append({"lost": request_id})

    def ended(self, request_id: str, at_once: bool = False) -> None:
        """at_once: the end of a request that never left the queue (see the module docstring)."""
        self._append({"end": request_id})
        if at_once:
            self.flush()

    def close(self) -> None:
        if self._f is not None:
            self.flush()
            self._f.close()
            self._f = None
