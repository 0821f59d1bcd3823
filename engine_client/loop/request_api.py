"""The engine's request API, what the server calls: submit, look up, resume and cancel a
request, and take back the requests a previous engine process left in the state file.

None of these runs the model: they queue a request (or drop it) and wake the loop, which does
the rest on its next turn (engine_client.loop.engine). The engine holds one, as `Engine.api`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from engine_client.client import errors
from engine_client.loop.failure import Failures
from engine_client.loop.finished import FinishedRequests
from engine_client.loop.release import Finisher
from engine_client.loop.request import Finish, GenRequest, Phase, SamplingParams
from engine_client.loop.scheduler import Scheduler
from engine_client.loop.state_file import StateFile
from engine_client.text.detokenizer import TextStream

log = logging.getLogger(__name__)


class RequestAPI:
    """The requests' side of the engine (`Engine.api`): what the server asks of it."""

    def __init__(
        self,
        scheduler: Scheduler,
        failures: Failures,
        finished: FinishedRequests,
        finisher: Finisher,
        state: StateFile | None,
        wake: asyncio.Event,
    ) -> None:
        self.scheduler, self.failures, self.finished = scheduler, failures, finished
        self._finish, self.state, self._wake = finisher.finish, state, wake

    def submit(
        self,
        prompt: tuple[int, ...],
        max_new_tokens: int,
        sampling: SamplingParams,
        text: TextStream | None = None,
        cache_salt: str = "",
    ) -> GenRequest:
        """Queue a request; `text` detokenizes its tokens (text output, stop strings);
        `cache_salt` keeps its cached prefix pages to requests of the same salt (a tenant)."""
        if self.failures.error is not None:
            raise self.failures.error
        req = GenRequest(
            uuid.uuid4().hex, prompt, max_new_tokens, sampling, text=text, cache_salt=cache_salt
        )
        self.scheduler.enqueue(req)
        if self.state is not None:  # before the id goes to the client: it must be resumable
            self.state.queued(req)
        self._wake.set()
        log.info(
            "request %s queued: %d prompt tokens, up to %d new",
            req.request_id,
            len(prompt),
            max_new_tokens,
        )
        return req

    def lookup(self, request_id: str) -> GenRequest:
        req = self.scheduler.requests.get(request_id) or self.finished.get(request_id)
        if req is None:
            raise errors.UnknownRequest(f"no request {request_id!r} in this engine")
        return req

    def resume(self, request_id: str) -> GenRequest:
        """The request a resumed stream follows: as it stands, or revived when it failed with
        its KV service and the engine has re-attached since (its KV is prefilled again, from
        the prompt and the tokens it had generated)."""
        req = self.lookup(request_id)
        serving = self.failures.error is None
        if req.lost_kv and serving and request_id not in self.scheduler.requests:
            req.revive()
            self.finished.take(request_id)
            self.scheduler.enqueue(req)
            if self.state is not None:  # queued again, tokens and all: a kill now loses nothing
                self.state.queued(req)
            self._wake.set()
            log.info("request %s revived after %d tokens", request_id, req.replayed)
        return req

    def cancel(self, req: GenRequest) -> None:
        """The client went away: drop the request now if queued, else at the next turn."""
        if req.finished:
            return
        req.cancelled = True
        if req.phase is Phase.WAITING:
            self.scheduler.dequeue(req)
            self._finish(req, Finish.CANCELLED)
        self._wake.set()

    def requeue(self, req: GenRequest) -> None:
        """A request the state file had queued when the previous engine process died."""
        self.scheduler.enqueue(req)
        self._wake.set()

    def keep_lost(self, req: GenRequest) -> None:
        """A request the state file saw lost with its KV service: revivable by a resume."""
        self.finished.keep(req)

    def adopt(self, req: GenRequest) -> None:
        """A request resumed from the state file whose slot the service still holds."""
        req.launched = len(req.tokens)
        self.scheduler.requests[req.request_id] = req
        self._wake.set()
