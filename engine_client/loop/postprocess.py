"""Post-processing of a finished step: deliver its tokens, end requests, report to the KV side.

Per step, on the host, while the device already runs the next step (overlap):
1. drop the rows of requests that ended while the step was in flight (a stop token found in the
   step before, or a cancel): the device computed them, nobody receives them;
2. append the step's tokens to the state file, one record for the whole step, before any client
   can see them;
3. hand each token to its request (one wake-up per stream), end requests on a stop token or at
   max_new_tokens; their slots are released later by the engine, once no launched step reads
   them;
4. queue the step's StepEnd: sent in the background, at most one in flight, later ones merged
   into one message while it is (coalesced).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from contract import errors
from engine_client.client.control import StepReport
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.launched_step import StepOutput
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.request import GenRequest
from engine_client.loop.state_file import StateFile

log = logging.getLogger(__name__)


def merge_reports(a: StepReport, b: StepReport) -> StepReport:
    """One report for steps a then b: b's stored lengths win, counters and step counts add up."""
    progress = dict(a.progress)
    progress.update(b.progress)
    return StepReport(
        b.step,
        tuple(progress.items()),
        a.hits + b.hits,
        a.misses + b.misses,
        a.bytes_moved + b.bytes_moved,
        a.steps + b.steps,
    )


class ReportSender:
    """StepEnd off the critical path: `send` never waits; `flush` waits until every report
    handed to it has been answered (a release must come after the reports that name it)."""

    def __init__(self, control: ControlRef) -> None:
        self.control = control
        self._pending: StepReport | None = None
        self._task: asyncio.Task | None = None
        self.sent = 0

    def send(self, report: StepReport) -> None:
        self._pending = report if self._pending is None else merge_reports(self._pending, report)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._pending is not None:
                report, self._pending = self._pending, None
                self.sent += 1
                try:
                    await self.control.current.step_end(report)
                except errors.ServiceUnavailable:
                    pass  # the next step's liveness check fails the requests
                except errors.KVError as e:
                    log.warning("StepEnd %d refused: %s", report.step, e)
        finally:
            self._task = None

    async def flush(self) -> None:
        task = self._task
        if task is not None:
            await asyncio.shield(task)


class Postprocessor:
    def __init__(
        self,
        row_bytes: int,
        state: StateFile | None,
        reports: ReportSender,
        metrics: EngineMetrics,
        finish: Callable[..., None],
    ) -> None:
        self.row_bytes, self.state, self.reports = row_bytes, state, reports
        self.metrics, self._finish = metrics, finish
        self.totals = {
            "hits": 0,
            "misses": 0,
            "bytes_moved": 0,
            "tokens": 0,
            "drafted": 0,
            "accepted": 0,
            "misses_rows": 0,
        }

    def __call__(self, out: StepOutput) -> None:
        batch = out.batch
        rows: list[tuple[GenRequest, list[int]]] = list(zip(batch.decode, out.decode_tokens))
        firsts = [(c.req, [t]) for c, t in zip(batch.prefills, out.prefill_tokens) if t is not None]
        for c, drafts in zip(batch.prefills, out.prefill_drafts):
            if drafts:  # the chunk ended its prompt in a speculative engine
                c.req.first_drafts = drafts
        rows = firsts + rows
        rows = [(r, self._kept(r, t)) for r, t in rows if not r.finished]
        # Requests that ended before this step was post-processed are left out of its report;
        # those that end with it are in: their last pages count as stored (prefix caching).
        live = {id(r) for r in batch.requests if not r.finished}
        if self.state is not None and rows:
            self.state.tokens({r.request_id: t for r, t in rows})
        # A prefill's slot counts too: the MTP layer's first drafts swap in (speculative).
        counted = batch.decode + [c.req for c in batch.prefills]
        hits, misses = self._count(counted, out.per_slot)
        self._speculative(out, counted)
        for req, tokens in zip(batch.decode, out.decode_tokens):
            # A verify step was launched as one token (engine_client.loop.batch_builder).
            req.launched += len(tokens) - 1
        self._deliver(rows)
        # Stored lengths once the step is done: what it appended and kept (a verify step keeps
        # its first row and the accepted drafts), whatever was delivered.
        kept = (len(t) for t in out.decode_tokens)
        stored = list(zip(batch.decode, (p + k for p, k in zip(out.positions, kept))))
        stored = [(c.req, c.end) for c in batch.prefills] + stored
        progress = tuple((r.request_id, n) for r, n in stored if id(r) in live)
        self.reports.send(StepReport(batch.step, progress, hits, misses, misses * self.row_bytes))

    @staticmethod
    def _kept(req: GenRequest, tokens: list[int]) -> list[int]:
        """The tokens a request takes: up to its first stop token and its max_new_tokens."""
        room = req.max_new_tokens - len(req.tokens)
        stop = next(
            (i for i, t in enumerate(tokens) if t in req.sampling.stop_token_ids), len(tokens)
        )
        return tokens[: min(room, stop + 1)]

    def _speculative(self, out: StepOutput, counted: list[GenRequest]) -> None:
        """Drafted and accepted tokens of a verify step, and its misses with and without the
        rows' shared swap-in (on the slots of the step's requests)."""
        rows_missed = sum(out.per_slot[r.slot][2] for r in counted)
        misses = sum(out.per_slot[r.slot][1] for r in counted)
        drafted, accepted = sum(out.drafted), sum(out.accepted)
        t = self.totals
        t["drafted"] += drafted
        t["accepted"] += accepted
        t["misses_rows"] += rows_missed
        self.metrics.speculative(drafted, accepted, misses, rows_missed)

    def _count(
        self, decode: list[GenRequest], per_slot: list[tuple[int, int, int]]
    ) -> tuple[int, int]:
        hits = misses = 0
        for req in decode:
            sel, miss, _ = per_slot[req.slot]
            c = req.counters
            c.hits, c.misses, c.bytes_moved = (
                c.hits + sel - miss,
                c.misses + miss,
                c.bytes_moved + miss * self.row_bytes,
            )
            hits, misses = hits + sel - miss, misses + miss
        t = self.totals
        t["hits"], t["misses"] = t["hits"] + hits, t["misses"] + misses
        t["bytes_moved"] += misses * self.row_bytes
        return hits, misses

    def _deliver(self, rows: list[tuple[GenRequest, list[int]]]) -> None:
        now = time.monotonic()
        first, gaps = [], []
        for req, tokens in rows:
            for token in tokens:
                (gaps.append(now - req.times[-1]) if req.times else first.append(now - req.started))
                reason = req.add_token(token, now)
                if reason is not None:
                    req.cancelled = False
                    self._finish(req, reason)
            self.totals["tokens"] += len(tokens)
        self.metrics.ttft.observe_many(first)
        self.metrics.itl.observe_many(gaps)
