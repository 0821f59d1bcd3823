"""How the engine fails: a lost KV service fails every request, a failed step fails its own.

A lost service (`fail_all`) leaves no memory to trust: every request ends with UNAVAILABLE, new
ones are refused, and `engine_client.loop.recovery` lets go of the lost memory and re-attaches
to a restarted service (`recovered`: new requests are served again). A request that was running
or queued keeps `lost_kv`, so that a resume after the re-attach prefills its KV again: the state
file marks it lost at once, and keeps it through the re-attach's rewrite, so that a restarted
engine can revive it too. Queued requests leave the scheduler at once (they hold no slot);
admitted ones once no launched step reads their slot (engine_client.loop.release). A failed
compute step (`step_failed`) leaves only its own requests' KV undefined: they end with INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engine_client.client import errors
from engine_client.loop.batch import Batch
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.finished import FinishedRequests
from engine_client.loop.recovery import ServiceRecovery
from engine_client.loop.request import FailStatus, Finish, GenRequest
from engine_client.loop.scheduler import Scheduler
from engine_client.loop.state_file import StateFile

log = logging.getLogger(__name__)

FinishFn = Callable[[GenRequest, Finish, str, FailStatus], None]
# What the client of a request failed with its KV service is told to do (the engine re-attaches
# on its own once a service is back).
RESUME_ADVICE = "resume with this request id once the engine serves again"


class Failures:
    """`error` is the failure every new request is refused with, None while serving."""

    def __init__(
        self,
        scheduler: Scheduler,
        control: ControlRef,
        recovery: ServiceRecovery,
        state: StateFile | None,
        finish: FinishFn,
        wake: asyncio.Event,
        finished: FinishedRequests,
    ) -> None:
        self.scheduler, self.control, self.recovery = scheduler, control, recovery
        self.state, self._finish, self._wake = state, finish, wake
        self.finished = finished
        self.error: errors.KVError | None = None

    def check_service(self) -> None:
        """Fail everything if the service is gone (an idle engine, or before a launch)."""
        if self.error is not None:
            return
        try:
            self.control.current.check_alive()
        except errors.ServiceUnavailable as e:
            self.fail_all(e)

    def fail_all(self, why: errors.KVError) -> None:
        """The KV service is gone (or the loop broke): every request fails now, new ones are
        refused with UNAVAILABLE. A step still in flight finishes before any slot is let go."""
        if self.error is None:
            log.error("failing %d requests: %s", len(self.scheduler.requests), why)
        lost = isinstance(why, errors.ServiceUnavailable)
        self.error = why if lost else errors.ServiceUnavailable(str(why))
        if lost:
            # The traceback holds the failed step's frames, and through them the lost memory.
            why.__traceback__ = None
            self.recovery.start(then=self.recovered)
        else:
            self.recovery.give_up()
        for req in self.scheduler.drop_waiting():
            self._fail(req, why, lost)
            self.finished.keep(req)  # where a resume finds it
        for req in list(self.scheduler.requests.values()):
            self._fail(req, why, lost)
        if self.state is not None:
            self.state.flush()

    def _fail(self, req: GenRequest, why: errors.KVError, lost: bool) -> None:
        if lost and not req.finished and not req.lost_kv:
            # Its KV went with the service: a resume after the re-attach prefills it again.
            req.lost_kv = True
            if self.state is not None:
                self.state.lost(req.request_id)
        said = f"{why}; {RESUME_ADVICE}: generate --resume {req.request_id}"
        self._finish(req, Finish.ERROR, said if req.lost_kv else str(why), FailStatus.UNAVAILABLE)

    def step_failed(self, batch: Batch | None, e: Exception) -> None:
        """A failed step leaves its requests' KV undefined. The log says which step it was,
        what it ran, and after how many service recoveries (a step that fails only on a
        re-attached service's memory shows here)."""
        log.error(
            "compute step %s failed (%d decode rows, prefill %s; %d KV service recoveries "
            "before it): %s: %s",
            batch.step if batch else "?",
            len(batch.decode) if batch else 0,
            " ".join(f"{c.req.request_id} [{c.start}, {c.end})" for c in batch.prefills)
            if batch and batch.prefills
            else "-",
            self.recovery.rounds,
            type(e).__name__,
            e,
            exc_info=e,
        )
        for req in batch.requests if batch else ():
            self._finish(
                req, Finish.ERROR, f"compute failed: {type(e).__name__}: {e}", FailStatus.INTERNAL
            )

    def recovered(self) -> None:
        """The control re-attached to a restarted service: serve again. The state file names
        the new session (an engine restarted later resumes it) and keeps the lost requests."""
        control = self.control.current
        if self.state is not None:
            epoch = getattr(control, "epoch", 0)
            waiting = list(self.scheduler.waiting)
            self.state.rewrite(control.session_id, epoch, [], waiting, self.finished.lost())
        self.error = None
        self._wake.set()
