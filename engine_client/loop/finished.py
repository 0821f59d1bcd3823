"""The requests the engine has let go of, kept for a late resume of their stream.

Every released request lands here (engine_client.loop.release), and so does a queued request
failed by a lost KV service (it held no slot: nothing to release). The most recent FINISHED_KEPT
are kept. Among them, the requests failed by a KV loss and not revived yet (`lost`) are
resumable: a resume revives them (engine_client.loop.request_api), in this engine or, through the
state file, in a restarted one. The state file therefore keeps them until they are revived or
dropped from here; one dropped gets its end record, so that a restarted engine does not keep what
this one no longer can resume.
"""

from __future__ import annotations

from collections import OrderedDict

from engine_client.loop.request import GenRequest
from engine_client.loop.state_file import StateFile

# Finished requests kept for a late resume of their stream.
FINISHED_KEPT = 1024


class FinishedRequests:
    """The most recent `kept` finished requests, by id, oldest first."""

    def __init__(self, state: StateFile | None, kept: int = FINISHED_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"kept must be >= 1, got {kept}")
        self.state, self.kept = state, kept
        self._requests: OrderedDict[str, GenRequest] = OrderedDict()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> GenRequest | None:
        return self._requests.get(request_id)

    def keep(self, req: GenRequest) -> None:
        """Keep `req`, dropping the oldest beyond `kept`."""
        self._requests[req.request_id] = req
        while len(self._requests) > self.kept:
            _, old = self._requests.popitem(last=False)
            if old.lost_kv:
                self._forget(old)

    def take(self, request_id: str) -> GenRequest:
        """Take `request_id` out (a revived request runs again)."""
        return self._requests.pop(request_id)

    def lost(self) -> list[GenRequest]:
        """The requests failed by a KV loss and not revived: what a resume may still revive."""
        return [r for r in self._requests.values() if r.lost_kv]

    def end_lost(self) -> None:
        """The engine stops and ends its session: the state file keeps no lost request."""
        for req in self.lost():
            self._forget(req)

    def _forget(self, req: GenRequest) -> None:
        if self.state is not None:
            self.state.ended(req.request_id)
