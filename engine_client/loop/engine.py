"""The continuous-batching decode engine: an asyncio loop that, each turn, runs

    release  ->  schedule  ->  run  ->  postprocess

1. release (engine_client.loop.release): requests that ended give their KV slot back, but only
   once the newest step that read it has finished on the device (`GenRequest.last_step` <=
   `done_step`): cancels, stop tokens, max-length finishes and errors all wait for that, so no
   launched step reads freed or reused KV and no new request is admitted into a slot a step
   still reads;
2. schedule (engine_client.loop.scheduler): admission under the queue policy, then the batch;
3. run (engine_client.loop.step_runner, on the compute thread): launch this turn's step, then
   wait for the previous one (overlap) or for this one (--no-overlap). The KV memory is checked
   before a launch and before a step's results are trusted;
4. postprocess (engine_client.loop.postprocess): tokens to the state file and the client streams,
   requests ended, StepEnd queued in the background.

With overlap the device runs step t while the host does 4 for t - 1 and 1-2 for t + 1.

The engine's parts, one concept each, are built once by engine_client.loop.parts: the request
API the server calls (`Engine.api`, engine_client.loop.request_api), release of ended requests
(engine_client.loop.release) and failure handling (engine_client.loop.failure: a lost KV service
fails every request; an idle engine looks at its service every IDLE_CHECK_SECONDS).
`engine_client.loop.recovery` then lets go of the lost memory once no step is in flight
(`failed`: NOT_SERVING) and re-attaches to a restarted service (`recovered`: serving again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from engine_client.client import errors
from engine_client.client.control import KVControl
from engine_client.client.prefill_router import PrefillRouter
from engine_client.loop.acceptance_rates import AcceptanceRates
from engine_client.loop.admission_limit import AdmissionLimit
from engine_client.loop.batch import Batch
from engine_client.loop.finished import FinishedRequests
from engine_client.loop.launched_step import LaunchedStep
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.page_names import PrefixReuse
from engine_client.loop.parts import EngineOptions, EngineParts
from engine_client.loop.queue_policy import QueueLimits
from engine_client.loop.request import Finish, GenRequest
from engine_client.loop.state_file import StateFile
from engine_client.loop.step_runner import Advance
from engine_client.model.compute import Compute
from engine_client.text.vocabulary import Vocabulary

log = logging.getLogger(__name__)

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
        admission: AdmissionLimit,
        admit_retry: float = 0.5,
        state: StateFile | None = None,
        policy: QueueLimits | None = None,
        overlap: bool = True,
        metrics: EngineMetrics | None = None,
        vocab: Vocabulary | None = None,
        prefix: PrefixReuse = PrefixReuse(),
        acceptance: AcceptanceRates | None = None,
        prefill_peers: PrefillRouter | None = None,
    ) -> None:
        """acceptance: BENCHMARK-ONLY synthetic acceptance of speculative drafts."""
        self.compute, self.state = compute, state
        # Text in, text out (the server tokenizes with it; requests detokenize with it).
        self.vocab = vocab
        self.policy = policy or QueueLimits(admit_retry=admit_retry)
        options = EngineOptions(self.policy, overlap, prefix, acceptance, prefill_peers)
        self._hold(EngineParts.build(compute, control, admission, state, metrics, options))
        # One thread runs every model call, in order (it holds the CUDA device and stream).
        self._executor = executor
        self.steps = 0
        self.done_step = -1  # every step up to this one has finished on the device
        # Set after every post-processed step (waiters clear it).
        self.stepped = asyncio.Event()
        self._inflight: LaunchedStep | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    def _hold(self, parts: EngineParts) -> None:
        """Keep the parts the loop drives (built once, in order, by EngineParts.build)."""
        self._control, self.metrics = parts.control, parts.metrics
        self.scheduler, self.step_runner = parts.scheduler, parts.step_runner
        self.reports, self.postprocess = parts.reports, parts.postprocess
        self.releaser, self.failures, self.recovery = parts.releaser, parts.failures, parts.recovery
        self.api, self._finish, self._finished = parts.api, parts.finisher.finish, parts.finished
        # Set while no step is in flight on the device; anything that happens sets `_wake`.
        self._quiet, self._wake = parts.device_quiet, parts.wake

    @property
    def control(self) -> KVControl:
        return self._control.current

    @property
    def failed(self) -> asyncio.Event:
        """Set once the KV service is lost and its memory let go of."""
        return self.recovery.failed

    @property
    def recovered(self) -> asyncio.Event:
        """Set once the control re-attached to a restarted service."""
        return self.recovery.recovered

    @property
    def failure(self) -> errors.KVError | None:
        """What new requests are refused with while the KV service is lost; None while serving."""
        return self.failures.error

    @property
    def finished(self) -> FinishedRequests:
        """Released requests, kept for a late resume of their stream."""
        return self._finished

    @property
    def requests(self) -> dict[str, GenRequest]:
        return self.scheduler.requests

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def totals(self) -> dict[str, int]:
        return self.postprocess.totals

    # --- the loop ---

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self, keep_requests: bool = False) -> None:
        """Stop the loop after the current step. keep_requests: leave every admitted request
        with the KV service (its lease), and every lost one, for a restarted engine to resume;
        else cancel and release them all, end the session and leave nothing to resume."""
        self._stopping = True
        self._wake.set()
        self.recovery.cancel()
        if self._task is not None:
            await self._task
        await self.reports.flush()
        if not keep_requests:
            for req in list(self.requests.values()):
                self._finish(req, Finish.CANCELLED)
            await self.releaser.release_ended(self.done_step)
            self._finished.end_lost()
        for req in list(self.requests.values()):
            req.end(Finish.ERROR, "the engine stopped; resume with this request id", resumable=True)
        if self.scheduler.remote is not None:
            await self.scheduler.remote.close()
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
            self.failures.fail_all(errors.KVError(f"engine loop crashed: {type(e).__name__}: {e}"))

    async def _loop(self) -> None:
        while not self._stopping:
            # Cleared before looking at the state: anything that happens from here on wakes us.
            self._wake.clear()
            began = time.perf_counter()
            await self.releaser.release_ended(self.done_step)
            try:
                batch = await self.scheduler.schedule()
            except errors.ServiceUnavailable as e:  # an admission found the service lost
                self.failures.fail_all(e)
                batch = None
            self.metrics.queue(len(self.waiting), self.scheduler.active())
            if batch is None and self._inflight is None:
                # A step checks the service itself; an idle engine must look too.
                self.failures.check_service()
                self.step_runner.idle()
                await self._idle(self.policy.admit_retry if self.waiting else IDLE_CHECK_SECONDS)
                continue
            await self._run_step(batch, began)
        if self._inflight is not None:  # stopping: let the launched step finish and deliver
            await self._run_step(None, time.perf_counter())

    def capacity_freed(self) -> None:
        """KV capacity came back outside the loop's own releases (a prefill engine's pages
        once their export is written): retry admission now."""
        self.scheduler.released()
        self._wake.set()

    def set_control(self, control: KVControl) -> None:
        """Use another KV control from now on: every part asks the one holder (ControlRef)."""
        self._control.current = control

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
                self.failures.fail_all(e)
        if self.failure is not None:
            batch = None  # its requests have failed: nothing to launch
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        adv: Advance = await loop.run_in_executor(
            self._executor, self.step_runner.advance, batch, self._inflight
        )
        ran = time.perf_counter() - t0
        self._advanced(adv, batch)
        launch = (
            adv.launched.launch_seconds
            if adv.launched is not None and self.step_runner.cuda
            else 0.0
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
            self.failures.fail_all(adv.error)  # the step lost its service (RemoteSwap): UNAVAILABLE
        elif adv.error is not None:
            self.failures.step_failed(batch, adv.error)
        if adv.done is not None:
            self.failures.check_service()  # nor trust what a step read while it was being lost
            if self.failure is None:
                self.postprocess(adv.done)
                self.steps += 1
                self.stepped.set()
                done = adv.done
                self.metrics.step(len(done.batch.decode), done.device_seconds, done.idle_before)
                self.scheduler.stepped(done.batch, done.decode_seconds)
