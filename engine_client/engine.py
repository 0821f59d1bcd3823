"""The continuous-batching decode engine: one asyncio task schedules, one compute thread runs the
model.

Each turn of the loop:
1. release requests that finished or were cancelled (their slots are free before the next step);
2. admit waiting requests in order while the batch has room. A capacity refusal
   (CapacityError / RESOURCE_EXHAUSTED) leaves the request queued; it is retried when one of our
   requests ends, or after `admit_retry` seconds (another engine may have freed capacity);
3. run one compute call on the compute thread: the next prefill chunk of one request, and one
   decode step over every running request (padded to a batch bucket by the runner);
4. check the KV memory is still trusted (service alive, same epoch), persist the new tokens to
   the state file, then hand them to the client streams;
5. send the step's StepEnd without waiting for the reply: it is bookkeeping, not on the path of
   the next step.

When the KV service is lost every request fails (UNAVAILABLE), the control lets go of the
service's memory at once (between steps, so nothing runs on it) and a recovery task waits for
the control to re-attach to a restarted service; then new requests are served again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from engine_client import errors
from engine_client.compute import Compute, StepResult
from engine_client.control import KVControl, StepReport
from engine_client.scheduler import Finish, GenRequest, Phase, SamplingParams
from engine_client.state_file import StateFile

log = logging.getLogger(__name__)

# Finished requests kept for a late resume of their stream.
FINISHED_KEPT = 1024
# How often an idle engine looks at its KV service, so that its health turns NOT_SERVING soon
# after the service is lost even when no request would have noticed.
IDLE_CHECK_SECONDS = 0.5


class Engine:
    def __init__(self, compute: Compute, control: KVControl, *, executor: ThreadPoolExecutor,
                 max_active: int, admit_retry: float, state: StateFile | None = None) -> None:
        self.compute = compute
        self.control = control
        self.max_active = max_active
        self.admit_retry = admit_retry
        self.state = state
        self.requests: dict[str, GenRequest] = {}
        self.finished: OrderedDict[str, GenRequest] = OrderedDict()
        self.waiting: deque[GenRequest] = deque()
        self.steps = 0
        self.failure: errors.KVClientError | None = None
        self.totals = {"hits": 0, "misses": 0, "bytes_moved": 0, "tokens": 0}
        self._wake = asyncio.Event()
        # Set once the KV service is lost (and its memory let go of); `recovered` once the
        # control re-attached to a restarted service and new requests are served again.
        self.failed = asyncio.Event()
        self.recovered = asyncio.Event()
        self._recovery: asyncio.Task | None = None
        # One thread runs every model call, in order (it holds the CUDA device and stream).
        self._executor = executor
        self._inflight: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._stopping = False

    # --- requests from the server ---

    def submit(self, prompt: tuple[int, ...], max_new_tokens: int,
               sampling: SamplingParams) -> GenRequest:
        if self.failure is not None:
            raise self.failure
        req = GenRequest(uuid.uuid4().hex, prompt, max_new_tokens, sampling)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self._wake.set()
        log.info("request %s queued: %d prompt tokens, up to %d new", req.request_id,
                 len(prompt), max_new_tokens)
        return req

    def lookup(self, request_id: str) -> GenRequest:
        req = self.requests.get(request_id) or self.finished.get(request_id)
        if req is None:
            raise errors.UnknownRequest(f"no request {request_id!r} in this engine")
        return req

    def cancel(self, req: GenRequest) -> None:
        """The client went away: drop the request now if queued, else at the next turn."""
        if req.finished:
            return
        req.cancelled = True
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
            self._finish(req, Finish.CANCELLED)
        self._wake.set()

    def adopt(self, req: GenRequest) -> None:
        """A request resumed from the state file whose slot the service still holds."""
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
        if self._recovery is not None:
            self._recovery.cancel()
        if self._task is not None:
            await self._task
        await asyncio.gather(*self._inflight, return_exceptions=True)
        if not keep_requests:
            for req in list(self.requests.values()):
                req.cancelled = True
            await self._reap()
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
            self._fail_all(errors.KVClientError(f"engine loop crashed: {type(e).__name__}: {e}"))

    async def _loop(self) -> None:
        while not self._stopping:
            # Cleared before looking at the state: anything that happens from here on wakes us.
            self._wake.clear()
            await self._reap()
            blocked = await self._admit()
            prefill = next((r for r in self.requests.values() if r.phase is Phase.PREFILL), None)
            batch = [r for r in self.requests.values() if r.phase is Phase.RUNNING]
            if prefill is None and not batch:
                # A step checks the service itself; an idle engine must look too.
                self._check_service()
                await self._idle(self.admit_retry if blocked else IDLE_CHECK_SECONDS)
                continue
            await self._step(prefill, batch[: self.compute.max_batch])

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

    async def _admit(self) -> bool:
        """Admit queued requests while there is room; True if the KV side refused capacity."""
        while self.waiting and self._active() < self.max_active and self.failure is None:
            req = self.waiting[0]
            try:
                adm = await self.control.admit(req.request_id, req.prompt_len, req.max_new_tokens)
            except errors.CapacityError as e:
                log.debug("request %s stays queued: %s", req.request_id, e)
                return True
            except errors.Draining as e:
                self.waiting.popleft()
                self._finish(req, Finish.ERROR, f"KV service unavailable: {e}")
                continue
            except errors.ServiceUnavailable as e:
                self._fail_all(e)
                return False
            except errors.KVClientError as e:
                self.waiting.popleft()
                self._finish(req, Finish.ERROR, f"admission refused: {e}")
                continue
            self.waiting.popleft()
            req.slot, req.phase = adm.slot, Phase.PREFILL
            if self.state is not None:
                self.state.started(req)
            log.info("request %s admitted to slot %d (mode %d)", req.request_id, adm.slot, adm.mode)
        return False

    def _active(self) -> int:
        return sum(r.phase in (Phase.PREFILL, Phase.RUNNING) for r in self.requests.values())

    async def _step(self, prefill: GenRequest | None, batch: list[GenRequest]) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.control.check_alive()  # never launch on memory of a lost service
            result = await loop.run_in_executor(self._executor, self.compute.step, prefill, batch)
            self.control.check_alive()  # nor trust what a step read while it was being lost
        except errors.ServiceUnavailable as e:
            self._fail_all(e)
            return
        except Exception as e:  # a failed step leaves these requests' KV undefined
            log.exception("compute step failed")
            for req in ([prefill] if prefill else []) + batch:
                self._finish(req, Finish.ERROR, f"compute failed: {type(e).__name__}: {e}")
            return
        self.steps += 1
        self._deliver(prefill, batch, result)

    def _deliver(self, prefill: GenRequest | None, batch: list[GenRequest],
                 result: StepResult) -> None:
        now = time.monotonic()
        new: dict[str, list[int]] = {}
        if prefill is not None and result.prefill_token is not None:
            new[prefill.request_id] = [result.prefill_token]
        for req, tok in zip(batch, result.decode_tokens):
            new[req.request_id] = [tok]
        if self.state is not None:
            self.state.tokens(new)  # before any client can see them
        if prefill is not None and result.prefill_token is not None:
            prefill.phase = Phase.RUNNING
        hits = misses = 0
        for req in batch:
            sel, miss = result.per_slot[req.slot]
            req.counters.hits += sel - miss
            req.counters.misses += miss
            req.counters.bytes_moved += miss * self.compute.row_bytes
            hits, misses = hits + sel - miss, misses + miss
        for rid, toks in new.items():
            req = self.requests[rid]
            reason = req.add_token(toks[0], now)
            self.totals["tokens"] += 1
            if reason is not None:
                req.cancelled = False
                self._finish(req, reason)
        self._report(batch, prefill, hits, misses)

    def _report(self, batch: list[GenRequest], prefill: GenRequest | None, hits: int,
                misses: int) -> None:
        nbytes = misses * self.compute.row_bytes
        for key, value in (("hits", hits), ("misses", misses), ("bytes_moved", nbytes)):
            self.totals[key] += value
        progress = tuple((r.request_id, r.stored_len) for r in batch + ([prefill] if prefill else [])
                         if not r.finished)
        report = StepReport(self.steps, progress, hits, misses, nbytes)
        task = asyncio.get_running_loop().create_task(self._send_report(report))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _send_report(self, report: StepReport) -> None:
        try:
            await self.control.step_end(report)
        except errors.ServiceUnavailable:
            pass  # the next step's liveness check fails the requests
        except errors.KVClientError as e:
            log.warning("StepEnd %d refused: %s", report.step, e)

    # --- ends ---

    def _finish(self, req: GenRequest, reason: Finish, error: str = "") -> None:
        """Mark the request ended; its slot is released at the start of the next turn."""
        if reason is Finish.ERROR:
            log.warning("request %s failed: %s", req.request_id, error)
        req.end(reason, error)
        self._wake.set()

    async def _reap(self) -> None:
        for req in list(self.requests.values()):
            if req.cancelled and not req.finished:
                self._finish(req, Finish.CANCELLED)
            if not req.finished:
                continue
            await self._release(req)
            del self.requests[req.request_id]
            self.finished[req.request_id] = req
            while len(self.finished) > FINISHED_KEPT:
                self.finished.popitem(last=False)

    async def _release(self, req: GenRequest) -> None:
        if req.slot >= 0 and self.failure is None:
            # A StepEnd still on its way may name this request: it must arrive first.
            await asyncio.gather(*self._inflight, return_exceptions=True)
            try:
                await self.control.release(req.request_id)
            except errors.KVClientError as e:
                log.warning("release of %s failed: %s", req.request_id, e)
        if self.state is not None and req.slot >= 0:
            self.state.ended(req.request_id)
        log.info("request %s %s after %d tokens", req.request_id, req.finish.name.lower(),
                 len(req.tokens))

    def _fail_all(self, why: errors.KVClientError) -> None:
        """The KV service is gone (or the loop broke): every request fails now, new ones are
        refused with UNAVAILABLE."""
        if self.failure is None:
            log.error("failing %d requests: %s", len(self.requests), why)
        self.failure = why if isinstance(why, errors.ServiceUnavailable) \
            else errors.ServiceUnavailable(str(why))
        if isinstance(why, errors.ServiceUnavailable) and self._recovery is None:
            # The traceback holds the failed step's frames, and through them the lost memory.
            why.__traceback__ = None
            # Called between steps only: nothing runs on the memory that is unmapped here.
            self.control.let_go(self.compute)
            self.recovered.clear()
            self._recovery = asyncio.get_running_loop().create_task(self._recover())
        self.failed.set()
        self.waiting.clear()
        for req in list(self.requests.values()):
            self._finish(req, Finish.ERROR, str(why))

    async def _recover(self) -> None:
        """Serve again once the control is attached to a restarted KV service."""
        try:
            await self.control.reattach(self.compute)
        except errors.KVClientError as e:
            log.error("KV service not re-attached: %s", e)
            return
        finally:
            self._recovery = None
        if self.state is not None:  # an engine restarted later resumes the new session
            self.state.rewrite(self.control.session_id, getattr(self.control, "epoch", 0), [])
        self.failure = None
        self.failed.clear()
        self.recovered.set()
        self._wake.set()
        log.info("KV service re-attached: serving new requests")
