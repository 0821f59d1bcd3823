"""The continuous-batching decode engine: an asyncio loop that, each turn, runs

    schedule  ->  run  ->  postprocess

1. release: requests that ended give their KV slot back, but only once the newest step that read
   it has finished on the device (`GenRequest.last_step` <= `done_step`): cancels, stop tokens,
   max-length finishes and errors all wait for that, so no launched step reads freed or reused
   KV and no new request is admitted into a slot a step still reads;
2. schedule (engine_client.loop.scheduler): admission under the queue policy, then the batch;
3. run (engine_client.loop.runner, on the compute thread): launch this turn's step, then wait
   for the
   previous one (overlap) or for this one (--no-overlap). The KV memory is checked before a
   launch and before a step's results are trusted;
4. postprocess (engine_client.loop.postprocess): tokens to the state file and the client streams,
   requests ended, StepEnd queued in the background.

With overlap the device runs step t while the host does 4 for t - 1 and 1-2 for t + 1.
Failure: a lost KV service fails every request (`_fail_all`, `failure`); an idle engine looks at
its service every IDLE_CHECK_SECONDS (`_check_service`). `engine_client.loop.recovery` then lets go
of the lost memory once no step is in flight (`failed`: NOT_SERVING) and re-attaches to a restarted
service (`recovered`: new requests are served).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from engine_client.client import errors
from engine_client.client.control import KVControl
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.postprocess import Postprocessor, ReportSender
from engine_client.loop.recovery import ServiceRecovery
from engine_client.loop.request import FailStatus, Finish, GenRequest, Phase, SamplingParams
from engine_client.loop.runner import Advance, LaunchedStep, StepRunner
from engine_client.loop.scheduler import Batch, QueueLimits, Scheduler
from engine_client.loop.state_file import StateFile
from engine_client.loop.synthetic import SyntheticContext
from engine_client.model.compute import Compute
from engine_client.text.detokenizer import TextStream
from engine_client.text.vocabulary import Vocabulary

log = logging.getLogger(__name__)

# Finished requests kept for a late resume of their stream.
FINISHED_KEPT = 1024
# How often an idle engine looks at its KV service, so that its health turns NOT_SERVING soon
# after the service is lost even when no request would have noticed.
IDLE_CHECK_SECONDS = 0.5


class Engine:
    def __init__(
        self,
        compute: Compute,
        control: KVControl,
        *,
        executor: ThreadPoolExecutor,
        max_active: int,
        admit_retry: float = 0.5,
        state: StateFile | None = None,
        policy: QueueLimits | None = None,
        overlap: bool = True,
        metrics: EngineMetrics | None = None,
        vocab: Vocabulary | None = None,
        prefix_cache: bool = False,
        share_generated: bool = True,
    ) -> None:
        self.compute, self.control, self.state = compute, control, state
        # Text in, text out (the server tokenizes with it; requests detokenize with it).
        self.vocab = vocab
        self.policy = policy or QueueLimits(admit_retry=admit_retry)
        self.metrics = metrics or EngineMetrics()
        self.scheduler = self._new_scheduler(max_active, prefix_cache, share_generated)
        self.runner = _step_runner(compute, overlap)
        self.reports = ReportSender(control)
        self.postprocess = Postprocessor(
            compute.row_bytes, state, self.reports, self.metrics, self._finish
        )
        self.finished: OrderedDict[str, GenRequest] = OrderedDict()
        self.failure: errors.KVError | None = None
        self.recovery = ServiceRecovery(
            control, compute, device_quiet=self.wait_device_quiet, on_recovered=self._recovered
        )
        # One thread runs every model call, in order (it holds the CUDA device and stream).
        self._executor = executor
        self._init_stepping()

    def _new_scheduler(
        self, max_active: int, prefix_cache: bool, share_generated: bool
    ) -> Scheduler:
        compute = self.compute
        return Scheduler(
            self.control,
            self.policy,
            max_active=max_active,
            max_batch=compute.max_batch,
            prefill_chunk=compute.prefill_chunk,
            synthetic=SyntheticContext(compute.synthetic_context, compute.synthetic_shared),
            finish=self._finish,
            lost=self._fail_all,
            admitted=self._admitted,
            prefix_cache=prefix_cache,
            share_generated=share_generated,
            draft_tokens=compute.draft_tokens,
        )

    def _init_stepping(self) -> None:
        """The step loop's state: step counts, the step in flight and the events around it."""
        self.steps = 0
        self.done_step = -1  # every step up to this one has finished on the device
        # Set after every post-processed step (waiters clear it).
        self.stepped = asyncio.Event()
        # Set while no step is in flight on the device.
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._wake = asyncio.Event()
        self._inflight: LaunchedStep | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def failed(self) -> asyncio.Event:
        """Set once the KV service is lost and its memory let go of."""
        return self.recovery.failed

    @property
    def recovered(self) -> asyncio.Event:
        """Set once the control re-attached to a restarted service."""
        return self.recovery.recovered

    @property
    def requests(self) -> dict[str, GenRequest]:
        return self.scheduler.requests

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def totals(self) -> dict[str, int]:
        return self.postprocess.totals

    # --- requests from the server ---

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
        if self.failure is not None:
            raise self.failure
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
        req = self.requests.get(request_id) or self.finished.get(request_id)
        if req is None:
            raise errors.UnknownRequest(f"no request {request_id!r} in this engine")
        return req

    def resume(self, request_id: str) -> GenRequest:
        """The request a resumed stream follows: as it stands, or revived when it failed with
        its KV service and the engine has re-attached since (its KV is prefilled again, from
        the prompt and the tokens it had generated)."""
        req = self.lookup(request_id)
        if req.lost_kv and self.failure is None and request_id not in self.requests:
            req.revive()
            del self.finished[request_id]
            self.scheduler.enqueue(req)
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

    def adopt(self, req: GenRequest) -> None:
        """A request resumed from the state file whose slot the service still holds."""
        req.launched = len(req.tokens)
        self.requests[req.request_id] = req
        self._wake.set()

    # --- the loop ---

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self, keep_requests: bool = False) -> None:
        """Stop the loop after the current step. keep_requests: leave every admitted request
        with the KV service (its lease) for a restarted engine to resume; else cancel and
        release them all and end the session."""
        self._stopping = True
        self._wake.set()
        self.recovery.cancel()
        if self._task is not None:
            await self._task
        await self.reports.flush()
        if not keep_requests:
            for req in list(self.requests.values()):
                self._finish(req, Finish.CANCELLED)
            await self._release_ended()
        for req in list(self.requests.values()):
            req.end(Finish.ERROR, "the engine stopped; resume with this request id")
        self._executor.shutdown(wait=True)
        await self.control.close(detach=not keep_requests)
        if self.state is not None:
            self.state.close()

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:
            # A bug in the loop must not leave client streams waiting forever.
            log.exception("engine loop crashed")
            self._fail_all(errors.KVError(f"engine loop crashed: {type(e).__name__}: {e}"))

    async def _loop(self) -> None:
        while not self._stopping:
            # Cleared before looking at the state: anything that happens from here on wakes us.
            self._wake.clear()
            began = time.perf_counter()
            await self._release_ended()
            batch = await self.scheduler.schedule()
            self.metrics.queue(len(self.waiting), self.scheduler.active())
            if batch is None and self._inflight is None:
                # A step checks the service itself; an idle engine must look too.
                self._check_service()
                self.runner.idle()
                await self._idle(self.policy.admit_retry if self.waiting else IDLE_CHECK_SECONDS)
                continue
            await self._run_step(batch, began)
        if self._inflight is not None:  # stopping: let the launched step finish and deliver
            await self._run_step(None, time.perf_counter())

    def set_control(self, control: KVControl) -> None:
        """Use another KV control from now on (a re-attach): the scheduler admits through it and
        StepEnd / release go to it."""
        self.control = self.scheduler.control = self.reports.control = control
        self.recovery.control = control

    async def wait_device_quiet(self) -> None:
        """Until no launched step runs on the device: after `failed`, the KV memory of the lost
        service may be unmapped once this returns (the loop waits for the step in flight)."""
        await self._quiet.wait()

    def _check_service(self) -> None:
        if self.failure is not None:
            return
        try:
            self.control.check_alive()
        except errors.ServiceUnavailable as e:
            self._fail_all(e)

    async def _idle(self, timeout: float | None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _run_step(self, batch: Batch | None, began: float) -> None:
        """Launch `batch` (if the KV memory is still trusted) and post-process the step that
        finished, if any."""
        if batch is not None and self.failure is None:
            try:
                self.control.check_alive()  # never launch on memory of a lost service
            except errors.ServiceUnavailable as e:
                self._fail_all(e)
        if self.failure is not None:
            batch = None  # its requests have failed: nothing to launch
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        adv: Advance = await loop.run_in_executor(
            self._executor, self.runner.advance, batch, self._inflight
        )
        ran = time.perf_counter() - t0
        self._advanced(adv, batch)
        launch = (
            adv.launched.launch_seconds if adv.launched is not None and self.runner.cuda else 0.0
        )
        rows = len(batch.requests) if batch is not None else 0
        self.metrics.host(time.perf_counter() - began - ran + launch, rows)

    def _advanced(self, adv: Advance, batch: Batch | None) -> None:
        """Take in what one advance did: the step now in flight, a failure, a finished step."""
        self._inflight = adv.launched
        (self._quiet.clear if adv.launched is not None else self._quiet.set)()
        # Steps finish in launch order: all but the one in flight are done.
        self.done_step = (
            adv.launched.batch.step - 1
            if adv.launched is not None
            else self.scheduler.next_step - 1
        )
        if isinstance(adv.error, errors.ServiceUnavailable):
            self._fail_all(adv.error)  # the step lost its service (RemoteSwap): UNAVAILABLE
        elif adv.error is not None:
            self._step_failed(batch, adv.error)
        if adv.done is not None:
            self._check_service()  # nor trust what a step read while it was being lost
            if self.failure is None:
                self.postprocess(adv.done)
                self.steps += 1
                self.stepped.set()
                self.metrics.step(
                    len(adv.done.batch.decode), adv.done.device_seconds, adv.done.idle_before
                )

    def _step_failed(self, batch: Batch | None, e: Exception) -> None:
        """A failed step leaves its requests' KV undefined. The log says which step it was,
        what it ran, and after how many service recoveries (a step that fails only on a
        re-attached service's memory shows here)."""
        log.error(
            "compute step %s failed (%d decode rows, prefill %s; %d KV service recoveries "
            "before it): %s: %s",
            batch.step if batch else "?",
            len(batch.decode) if batch else 0,
            f"{batch.prefill.request_id} {batch.prefill_range}" if batch and batch.prefill else "-",
            self.recovery.rounds,
            type(e).__name__,
            e,
            exc_info=e,
        )
        for req in batch.requests if batch else ():
            self._finish(
                req, Finish.ERROR, f"compute failed: {type(e).__name__}: {e}", FailStatus.INTERNAL
            )

    # --- ends ---

    def _admitted(self, req: GenRequest) -> None:
        if self.state is not None:
            self.state.started(req)

    def _finish(
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
        self._wake.set()

    async def _release_ended(self) -> None:
        for req in list(self.requests.values()):
            if not req.finished or req.last_step > self.done_step:
                continue  # live, or a launched step still reads its KV
            await self._release(req)
            del self.requests[req.request_id]
            self.finished[req.request_id] = req
            while len(self.finished) > FINISHED_KEPT:
                self.finished.popitem(last=False)

    async def _release(self, req: GenRequest) -> None:
        if req.slot >= 0 and self.failure is None:
            # A StepEnd still on its way may name this request: it must arrive first.
            await self.reports.flush()
            try:
                await self.control.release(req.request_id, self.scheduler.names.release(req))
            except errors.KVError as e:
                log.warning("release of %s failed: %s", req.request_id, e)
            self.scheduler.released()
        if self.state is not None:  # admitted, or only queued (its queued record ends too)
            self.state.ended(req.request_id)
        assert req.finish is not None  # only finished requests are released
        log.info(
            "request %s %s after %d tokens",
            req.request_id,
            req.finish.name.lower(),
            len(req.tokens),
        )

    def _fail_all(self, why: errors.KVError) -> None:
        """The KV service is gone (or the loop broke): every request fails now, new ones are
        refused with UNAVAILABLE. A step still in flight finishes before any slot is let go."""
        if self.failure is None:
            log.error("failing %d requests: %s", len(self.requests), why)
        lost = isinstance(why, errors.ServiceUnavailable)
        self.failure = why if lost else errors.ServiceUnavailable(str(why))
        if lost:
            # The traceback holds the failed step's frames, and through them the lost memory.
            why.__traceback__ = None
            self.recovery.start()
        else:
            self.recovery.give_up()
        for req in list(self.waiting):
            self.scheduler.dequeue(req)
        for req in list(self.requests.values()):
            # Its KV went with the service: a resume after the re-attach prefills it again.
            req.lost_kv = req.lost_kv or (lost and not req.finished)
            self._finish(req, Finish.ERROR, str(why))

    def _recovered(self) -> None:
        """The control re-attached to a restarted service: serve again."""
        if self.state is not None:  # an engine restarted later resumes the new session
            epoch = getattr(self.control, "epoch", 0)
            self.state.rewrite(self.control.session_id, epoch, [], list(self.waiting))
        self.failure = None
        self._wake.set()


def _step_runner(compute: Compute, overlap: bool) -> StepRunner:
    if compute.draft_tokens and overlap:
        raise ValueError(
            "speculative steps cannot be overlapped (their positions follow "
            "the previous step's accepted count)"
        )
    return StepRunner(compute, overlap=overlap)
