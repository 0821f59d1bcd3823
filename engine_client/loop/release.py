"""The end of a request's life in the engine: it is marked ended (`Finisher`), then its KV slot
goes back to the service (`Releaser`).

An ended request (cancelled, stopped, finished or failed) keeps its slot until the newest step
that read it has finished on the device (`GenRequest.last_step` <= the engine's `done_step`):
until then a launched step may still read that KV, and a new request admitted into the slot
would have it overwritten under that step. Released requests stay a while in `finished`
(engine_client.loop.finished) so that a late resume of their stream still finds them.
"""

from __future__ import annotations

import asyncio
import logging

from engine_client.client import errors
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.failure import Failures
from engine_client.loop.finished import FinishedRequests
from engine_client.loop.postprocess import ReportSender
from engine_client.loop.request import FailStatus, Finish, GenRequest
from engine_client.loop.scheduler import Scheduler
from engine_client.loop.state_file import StateFile

log = logging.getLogger(__name__)


class Finisher:
    """Marks requests ended; every part that ends one (the scheduler, post-processing, failure
    handling, a cancel, the engine's stop) calls `finish`. It wakes the loop, which releases."""

    def __init__(self, state: StateFile | None, wake: asyncio.Event) -> None:
        self.state, self._wake = state, wake

    def finish(
        self,
        req: GenRequest,
        reason: Finish,
        error: str = "",
        status: FailStatus = FailStatus.UNAVAILABLE,
    ) -> None:
        """Mark the request ended; its slot is released once no launched step reads it."""
        if req.finished:
            return
        if reason is Finish.ERROR:
            log.warning("request %s failed: %s", req.request_id, error)
        req.end(reason, error, status)
        if self.state is not None and req.unadmitted:
            # On disk before anything else: its queued record alone would make an engine
            # killed now run it again after the restart, for a client that went away.
            self.state.ended(req.request_id, at_once=True)
        self._wake.set()


class Releaser:
    """Releases ended requests' slots and hands them to `finished`. While the service is lost
    (`failures.error`), its memory is not trusted and there is no service to give a slot back
    to."""

    def __init__(
        self,
        scheduler: Scheduler,
        control: ControlRef,
        reports: ReportSender,
        state: StateFile | None,
        failures: Failures,
        finished: FinishedRequests,
    ) -> None:
        self.scheduler, self.control, self.reports = scheduler, control, reports
        self.state, self.failures, self.finished = state, failures, finished

    async def release_ended(self, done_step: int) -> None:
        """Release every ended request that no step up to `done_step` still reads."""
        requests = self.scheduler.requests
        for req in list(requests.values()):
            if not req.finished or req.last_step > done_step:
                continue  # live, or a launched step still reads its KV
            if self.scheduler.remote is not None and self.scheduler.remote.pending(req):
                continue  # a prefill peer may still write its pages
            await self._release(req)
            del requests[req.request_id]
            self.finished.keep(req)

    async def _release(self, req: GenRequest) -> None:
        if req.slot >= 0 and self.failures.error is None:
            # A StepEnd still on its way may name this request: it must arrive first.
            await self.reports.flush()
            try:
                names = self.scheduler.names.release(req)
                await self.control.current.release(req.request_id, names)
            except errors.KVError as e:
                log.warning("release of %s failed: %s", req.request_id, e)
            self.scheduler.released()
        # An unadmitted request's end is written at its end (Finisher.finish); one failed by a
        # KV loss has none: it stays resumable (engine_client.loop.finished).
        if self.state is not None and not req.unadmitted and not req.lost_kv:
            self.state.ended(req.request_id)
        assert req.finish is not None  # only finished requests are released
        log.info(
            "request %s %s after %d tokens",
            req.request_id,
            req.finish.name.lower(),
            len(req.tokens),
        )
