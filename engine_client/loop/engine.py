"""The continuous-batching decode engine: an asyncio loop that, each turn, runs

    schedule  ->  run  ->  postprocess

1. release: requests that ended give their KV slot back, but only once the newest step that read
   it has finished on the device (`GenRequest.last_step` <= `done_step`): cancels, stop tokens,
   max-length finishes and errors all wait for that, so no launched step reads freed or reused
   KV and no new request is admitted into a slot a step still reads;
2. schedule (engine_client.loop.scheduler): admission under the queue policy, then the batch;
3. run (engine_client.loop.runner, on the compute thread): launch this turn's step, then wait
   for the previous one (overlap) or for this one (--no-overlap). The KV memory is checked before
   a launch and before a step's results are trusted;
4. postprocess (engine_client.loop.postprocess): tokens to the state file and the client streams,
   requests ended, StepEnd queued in the background.

With overlap the device runs step t while the host does 4 for t - 1 and 1-2 for t + 1.
The engine's parts, one concept each: the request API the server calls
(engine_client.loop.request_api, the engine's base class), release of ended requests
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
from engine_client.loop.admission_limit import AdmissionLimit
from engine_client.loop.failure import Failures
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.postprocess import Postprocessor, ReportSender
from engine_client.loop.queue_policy import QueueLimits
from engine_client.loop.recovery import ServiceRecovery
from engine_client.loop.release import Releaser
from engine_client.loop.request import Finish, GenRequest
from engine_client.loop.request_api import RequestAPI
from engine_client.loop.runner import Advance, LaunchedStep, StepRunner
from engine_client.loop.scheduler import Batch, Scheduler
from engine_client.loop.state_file import StateFile
from engine_client.loop.synthetic import SyntheticContext
from engine_client.model.compute import Compute
from engine_client.text.vocabulary import Vocabulary

log = logging.getLogger(__name__)

# How often an idle engine looks at its KV service, so that its health turns NOT_SERVING soon
# after the service is lost even when no request would have noticed.
IDLE_CHECK_SECONDS = 0.5


class Engine(RequestAPI):
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
        prefix_cache: bool = False,
        share_generated: bool = True,
    ) -> None:
        self.compute, self.control, self.state = compute, control, state
        # Text in, text out (the server tokenizes with it; requests detokenize with it).
        self.vocab = vocab
        self.policy = policy or QueueLimits(admit_retry=admit_retry)
        self.metrics = metrics or EngineMetrics()
        self.metrics.watch_admission(admission)
        self.scheduler = self._new_scheduler(admission, prefix_cache, share_generated)
        self.runner = _step_runner(compute, overlap)
        self.reports = ReportSender(control)
        self.postprocess = Postprocessor(
            compute.row_bytes, state, self.reports, self.metrics, self._finish
        )
        # One thread runs every model call, in order (it holds the CUDA device and stream).
        self._executor = executor
        self._init_stepping()
        self._init_ends()

    def _new_scheduler(
        self, admission: AdmissionLimit, prefix_cache: bool, share_generated: bool
    ) -> Scheduler:
        compute = self.compute
        return Scheduler(
            self.control,
            self.policy,
            admission=admission,
            max_batch=compute.max_batch,
            prefill_chunk=compute.prefill_chunk,
            synthetic=SyntheticContext(compute.synthetic_context, compute.synthetic_shared),
            finish=self._finish,
            lost=lambda why: self.failures.fail_all(why),
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

    def _init_ends(self) -> None:
        """Who releases ended requests, and who fails them and recovers from a lost service."""
        self.releaser = Releaser(
            self.scheduler, self.reports, self.state, serving=lambda: self.failure is None
        )
        self.failures = Failures(self.scheduler, self.state, self._finish, self._wake)
        self.recovery = ServiceRecovery(
            self.control,
            self.compute,
            device_quiet=self.wait_device_quiet,
            on_recovered=self.failures.recovered,
        )
        self.failures.recovery = self.recovery

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
    def finished(self) -> dict[str, GenRequest]:
        """Released requests, kept for a late resume of their stream."""
        return self.releaser.finished

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
            await self.releaser.release_ended(self.done_step)
        for req in list(self.requests.values()):
            req.end(Finish.ERROR, "the engine stopped; resume with this request id", resumable=True)
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
            batch = await self.scheduler.schedule()
            self.metrics.queue(len(self.waiting), self.scheduler.active())
            if batch is None and self._inflight is None:
                # A step checks the service itself; an idle engine must look too.
                self.failures.check_service()
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

    # --- ends ---

    def _admitted(self, req: GenRequest) -> None:
        if self.state is not None:
            self.state.started(req)


def _step_runner(compute: Compute, overlap: bool) -> StepRunner:
    if compute.draft_tokens and overlap:
        raise ValueError(
            "speculative steps cannot be overlapped (their positions follow "
            "the previous step's accepted count)"
        )
    return StepRunner(compute, overlap=overlap)
