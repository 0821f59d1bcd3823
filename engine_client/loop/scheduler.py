"""The scheduler: decides what the next engine step runs.

Each turn it
1. ends requests whose client went away (they leave the batch; their slot is released later,
   once the last step that read it has finished on the device);
2. admits queued requests into free request slots (the KV side reserves prompt +
   max_new_tokens), under the queue policy below;
3. has the batch built (engine_client.loop.batch_builder): the next prefill chunks of the
   requests in prefill, a chunk's tokens in all, and one decode row for every running request
   that still has tokens to produce.

The queue (issue 11):
- A request the KV side refuses as permanently too large (CapacityError.permanent) ends at once
  with INVALID_ARGUMENT and its numbers (no client should retry it); the requests behind it go on.
- The queue is tried in order; once a request was refused for capacity, the queue policy
  (engine_client.loop.queue_policy: FIFO, or bounded skip-ahead) says whether the requests
  behind it may be tried this turn.
- A request queued longer than `max_queue_wait` ends with RESOURCE_EXHAUSTED and a message
  naming what held it last: the admission limit, or KV capacity.
- After a refusal, admission is retried when one of our requests was released or `admit_retry`
  seconds later, not at every step (each attempt is an RPC in service modes).
- How many requests may run at once is the admission limit's (engine_client.loop.admission_limit):
  a fixed capacity, or adaptive; `stepped` tells it what each step cost.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable

from engine_client.client import errors
from engine_client.loop.admission_limit import AdmissionLimit
from engine_client.loop.batch import Batch
from engine_client.loop.batch_builder import BatchBuilder
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.page_names import PageNames, PrefixReuse
from engine_client.loop.queue_policy import QueueLimits, Turn, reserved_tokens
from engine_client.loop.remote_prefill import RemotePrefill
from engine_client.loop.request import FailStatus, Finish, GenRequest, Phase
from engine_client.loop.speculative import reserve_extra
from engine_client.loop.state_file import StateFile
from engine_client.loop.synthetic import SyntheticContext

log = logging.getLogger(__name__)

# Refused admission attempts per turn, head included: each costs an RPC in service modes.
MAX_REFUSALS_PER_TURN = 4


class Admit(enum.Enum):
    ADMITTED, REFUSED, ENDED = 1, 2, 3  # refused: no capacity now; ended: for good, or an error


class Scheduler:
    """Owns the queue and the admitted requests (`requests`: every request not yet released)."""

    def __init__(
        self,
        control: ControlRef,
        policy: QueueLimits,
        *,
        admission: AdmissionLimit,
        max_batch: int,
        prefill_chunk: int,
        synthetic: SyntheticContext,
        finish: Callable[..., None],
        state: StateFile | None,
        clock: Callable[[], float] = time.monotonic,
        prefix: PrefixReuse = PrefixReuse(),
        draft_tokens: int = 0,
        remote: RemotePrefill | None = None,
    ) -> None:
        """draft_tokens D > 0: speculative steps of D + 1 rows per request (admission reserves
        their rows past max_new_tokens, an overlapped step's included). `finish` ends a
        request; `state` records each admission; `remote` prefills admitted requests on a
        peer (disaggregation) instead of here."""
        self.control, self.policy = control, policy
        self.admission, self.synthetic = admission, synthetic
        # Prefix caching: the page names admissions look up and releases publish.
        self.names = PageNames(control, synthetic, prefill_chunk, prefix)
        self._finish, self.state, self.clock = finish, state, clock
        self.requests: dict[str, GenRequest] = {}
        self.waiting: deque[GenRequest] = deque()
        self.queued_at: dict[str, float] = {}
        # What held a queued request at the last admission turn, for its expiry message: the
        # admission limit, else (no entry) KV capacity.
        self.held: dict[str, str] = {}
        self.next_step = 0
        self.refused = False  # the last admission attempt was refused for capacity
        self._retry_at = 0.0
        self.reserve_extra = reserve_extra(draft_tokens)
        self.builder = BatchBuilder(max_batch, prefill_chunk, synthetic, draft_tokens, clock)
        self.remote = remote

    # --- the queue ---

    def enqueue(self, req: GenRequest) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.queued_at[req.request_id] = self.clock()

    def dequeue(self, req: GenRequest) -> None:
        self.waiting.remove(req)
        self.queued_at.pop(req.request_id, None)
        self.held.pop(req.request_id, None)

    def drop_waiting(self) -> list[GenRequest]:
        """Take every queued request out of the scheduler (the KV service is lost): none holds
        a slot, so none waits for a release."""
        dropped = list(self.waiting)
        for req in dropped:
            self.dequeue(req)
            del self.requests[req.request_id]
        return dropped

    def released(self) -> None:
        """One of our requests gave its capacity back: retry admission now."""
        self._retry_at = 0.0

    def active(self) -> int:
        busy = (Phase.PREFILL, Phase.REMOTE, Phase.RUNNING)
        return sum(r.phase in busy for r in self.requests.values())

    def stepped(self, batch: Batch, decode_seconds: float) -> None:
        """A step finished after `decode_seconds` of decode time: what its batch size costs."""
        self.admission.observe(len(batch.decode), decode_seconds, bool(self.waiting))

    # --- one turn ---

    async def schedule(self) -> Batch | None:
        """This turn's batch, None when there is nothing to run. Raises ServiceUnavailable when
        an admission found the KV service lost (the engine then fails every request)."""
        for req in self.requests.values():
            if req.cancelled and not req.finished:
                self._finish(req, Finish.CANCELLED)
        self._expire()
        if self.waiting and self.clock() >= self._retry_at:
            await self._admit()
        return self._batch()

    def _expire(self) -> None:
        limit = self.policy.max_queue_wait
        if not limit:
            return
        now = self.clock()
        for req in [r for r in self.waiting if now - self.queued_at[r.request_id] > limit]:
            waited = now - self.queued_at[req.request_id]
            why = self.held.get(
                req.request_id, f"for KV capacity for {reserved_tokens(req)} tokens"
            )
            self.dequeue(req)
            self._finish(
                req,
                Finish.ERROR,
                f"waited {waited:.1f} s {why} (max queue wait {limit:g} s)",
                FailStatus.RESOURCE_EXHAUSTED,
            )

    async def _admit(self) -> None:
        """Admit in queue order; behind a refused head, as the queue policy says. A request
        left queued is held by the admission limit when the limit stopped the turn before it,
        else by KV capacity (refused, or behind a refused head)."""
        self.refused = False
        self.held.clear()
        head: GenRequest | None = None
        head_since, refusals = 0.0, 0
        queue = list(self.waiting)
        for i, req in enumerate(queue):
            if not self.admission.allows(self.active()):
                why = f"for admission: admission limit {self.admission.limit} reached"
                self.held.update((r.request_id, why) for r in queue[i:])
                break
            if refusals >= MAX_REFUSALS_PER_TURN:
                break
            if req.finished:  # cancelled while an admission of this turn was on its way
                continue
            if head is not None:
                # The head's queued time as refused: a cancel may have dequeued it since.
                turn = self.policy.order.after_refusal(req, head, self.clock() - head_since)
                if turn is Turn.STOP:
                    break
                if turn is Turn.SKIP:
                    continue
            since = self.queued_at[req.request_id]
            outcome = await self._try_admit(req)
            if outcome is Admit.REFUSED:
                refusals += 1
                if head is None:
                    head, head_since = req, since
        if refusals:
            self.refused = True
            self._retry_at = self.clock() + self.policy.admit_retry

    async def _try_admit(self, req: GenRequest) -> Admit:
        try:
            adm = await self.control.current.admit(
                req.request_id,
                req.prompt_len,
                req.max_new_tokens + self.reserve_extra,
                self.names.lookup(req),
            )
        except errors.KVError as e:
            return self._refused(req, e)
        if req.finished:
            # Cancelled (and dequeued) while the admission was on its way: the slot is its,
            # and the releaser gives it back as for any ended request.
            req.slot = adm.slot
            return Admit.ENDED
        self.dequeue(req)
        req.slot, req.phase, req.admitted_at = adm.slot, Phase.PREFILL, self.clock()
        req.cached_tokens = req.prefilled = adm.cached_tokens
        if self.state is not None:
            self.state.started(req)
        log.info(
            "request %s admitted to slot %d (mode %d, %d prompt tokens cached)",
            *(req.request_id, adm.slot, adm.mode, adm.cached_tokens),
        )
        if self.remote is not None:
            self.remote.start(req, adm)
        return Admit.ADMITTED

    def _refused(self, req: GenRequest, e: errors.KVError) -> Admit:
        """What a refused admission means for the request: wait, fail, or the service is lost."""
        if isinstance(e, errors.CapacityError) and not getattr(e, "permanent", False):
            log.debug("request %s stays queued: %s", req.request_id, e)
            return Admit.REFUSED
        if isinstance(e, errors.ServiceUnavailable) and not isinstance(e, errors.Draining):
            raise e  # the service is lost: no request waits on it
        if req.finished:  # cancelled (and dequeued) meanwhile: nothing left to end
            return Admit.ENDED
        self.dequeue(req)
        if isinstance(e, errors.CapacityError):
            why = f"the request can never fit the KV capacity: {e}"
            self._finish(req, Finish.ERROR, why, FailStatus.INVALID_ARGUMENT)
        elif isinstance(e, errors.Draining):
            self._finish(req, Finish.ERROR, f"KV service unavailable: {e}")
        else:
            self._finish(req, Finish.ERROR, f"admission refused: {e}")
        return Admit.ENDED

    # --- the batch ---

    def _batch(self) -> Batch | None:
        live = [r for r in self.requests.values() if not r.finished]
        batch = self.builder.build(live, self.next_step)
        if batch is not None:
            self.next_step += 1
        return batch
