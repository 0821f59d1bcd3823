"""A prefill engine's side of disaggregation (`serve --role prefill`): its NIXL agent over the
baseline cache, and the exports that wait for their request's release.

The engine prefills a request as any other (max_new_tokens 1: the prefill samples the first
token), so its rows and index keys are bit for bit those of a single-node run. Its KV control
(`engine_client.kv.export_control`) writes them into the decode side's pages when the loop
releases the request: the loop releases a slot only once every launched step that wrote it has
finished, so that is the first moment the rows are whole; the pages stay held until the write
ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from contract.errors import LayoutMismatch
from contract.nixl_agent import NixlAgent
from contract.transfer_target import INDEX, ROWS, TransferTarget, prompt_spans
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.export_source import export_source

log = logging.getLogger(__name__)

# Writes under way at once, on threads of their own: the loop no longer waits for a release's
# write, so a burst of prompts ends in as many writes, which must not take the event loop's
# default threads (tokenization uses them); staged ones queue on their buffer's lock anyway.
WRITERS = 8

# What must match between the prefill cache and the decode side's memory for rows to be
# copied as bytes (the layer count, the page size, the two formats).
SAME = ("num_layers", "page_size", "row_format", "index_format")


@dataclass
class _Pending:
    target: TransferTarget
    pages: tuple[int, ...]
    tokens: int
    cached_tokens: int
    done: asyncio.Future[Written]


@dataclass(frozen=True)
class Written:
    """One export's bytes and the seconds its NIXL write took, from posting to completion (a
    staged export's gather into the staging buffer, and its wait for it, not included)."""

    nbytes: int
    seconds: float
    # Each region's part (rows, index keys): seconds from posting to completion.
    region_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class ExportTotals:
    """Since the start: exports written and dropped, bytes and write seconds summed (also by
    region)."""

    written: int = 0
    dropped: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    region_seconds: dict[str, float] = field(default_factory=dict)


class BusyClock:
    """Wall seconds during which at least one write was under way. Direct writes run at once
    on worker threads, so summed write seconds overstate the time the link was busy: bytes
    over these seconds is the throughput while writing, bytes over the sum a single write's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self.seconds = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self._clock()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            assert self._active >= 0, "a write ended twice"
            if self._active == 0:
                self.seconds += self._clock() - self._since


class RowExport:
    """The agent with the baseline cache's rows and index keys registered (or the staging
    buffer's: `export_source`), and the pending exports by request id."""

    def __init__(
        self,
        backend: BaselineBackend,
        source: str = "direct",
        peer_idle: float = 60.0,
        agent: NixlAgent | None = None,
    ) -> None:
        """`peer_idle`: seconds a decode side's agent stays loaded after its last export;
        `agent`: made here unless given (tests)."""
        self.layout = lay = backend.layout
        self.agent = agent or NixlAgent(f"prefill-{os.getpid()}")
        rows, index, P = backend.stored_rows, backend.stored_index, lay.page_size
        try:
            self.source = export_source(
                self.agent, rows, index, P, lay.max_pages_per_request, source
            )
        except BaseException:
            self.agent.close()
            raise
        self._pending: dict[str, _Pending] = {}
        self._writing: Counter[str] = Counter()  # writes under way, by the target's agent
        self._idle: dict[str, asyncio.TimerHandle] = {}  # each loaded peer's forgetting
        self.peer_idle = peer_idle
        self.totals = ExportTotals()
        self.busy = BusyClock()
        self._threads = ThreadPoolExecutor(WRITERS, thread_name_prefix="nixl-write")

    def check(self, target: TransferTarget) -> None:
        """Refuse a target whose rows are not ours byte for byte."""
        ours, theirs = self.layout.to_dict(), target.layout.to_dict()
        wrong = [k for k in SAME if ours[k] != theirs[k]]
        if wrong:
            # One layer apart: one side runs --speculative mtp (the MTP layer's KV is the
            # layout's last layer), the other does not.
            mtp = abs(ours["num_layers"] - theirs["num_layers"]) == 1
            hint = "; run both with --speculative mtp, or neither" if mtp else ""
            raise LayoutMismatch(
                "the prefill cache and the decode side differ in "
                + ", ".join(f"{k} ({ours[k]} here, {theirs[k]} there)" for k in wrong)
                + hint
            )

    def expect(
        self,
        request_id: str,
        target: TransferTarget,
        pages: Sequence[int],
        tokens: tuple[int, int],
    ) -> asyncio.Future[Written]:
        """Export the request's rows [cached, prompt) (`tokens`: cached, prompt) into `pages`
        of `target` at its release; the future gets what was written (or the failure)."""
        self.check(target)
        done = asyncio.get_running_loop().create_future()
        cached, prompt = tokens
        self._pending[request_id] = _Pending(target, tuple(pages), prompt, cached, done)
        return done

    async def export(self, request_id: str, src_pages: Sequence[int]) -> None:
        """Write a released request's rows if an export waits for them (in a thread: the
        write polls until UCX is done). A caller gone before or during the write counts the
        export dropped, and its decode side is forgotten unless another export needs it."""
        job = self._pending.pop(request_id, None)
        if job is None:
            return
        peer = job.target.agent_name
        if job.done.done():
            self._dropped(peer, forget=True)
            return
        self._writing[peer] += 1
        try:
            run = asyncio.get_running_loop().run_in_executor
            written = await run(self._threads, self._write, job, src_pages)
        except Exception as e:
            if not job.done.done():
                job.done.set_exception(e)
            written = None
        finally:
            self._writing[peer] -= 1
        if written is None or job.done.done():  # failed, or the caller went away meanwhile
            self._dropped(peer, forget=True)  # the decode side may be gone for good
            return
        self.totals.written += 1
        self.totals.nbytes += written.nbytes
        self.totals.seconds += written.seconds
        for name, seconds in written.region_seconds.items():
            self.totals.region_seconds[name] = self.totals.region_seconds.get(name, 0.0) + seconds
        job.done.set_result(written)
        self._forget_later(peer)

    def _forget_later(self, peer: str) -> None:
        """A decode side that dies between prompts tells nobody: its agent is forgotten once it
        has been idle `peer_idle` seconds (a later export loads it again)."""
        if (old := self._idle.pop(peer, None)) is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._idle[peer] = loop.call_later(self.peer_idle, self._forget_if_idle, peer)

    def _write(self, job: _Pending, src_pages: Sequence[int]) -> Written:
        with self.source.pages(src_pages) as pages:
            plan = [(name, self._spans(job, name, pages)) for name in (ROWS, INDEX)]
            with self.busy:
                start = time.monotonic()
                nbytes, regions = self.agent.write_timed(job.target, plan)
                seconds = time.monotonic() - start
        return Written(nbytes, seconds, regions)

    def _spans(self, job: _Pending, name: str, src_pages: Sequence[int]) -> list[Any]:
        src, dst = self.agent.region(name), job.target.region(name)
        return prompt_spans(
            self.layout, src, dst, src_pages, job.pages, job.tokens, job.cached_tokens
        )

    def drop(self, request_id: str, caller_gone: bool = False) -> None:
        """Forget a request's export; `caller_gone`: the decode side went away (killed, or
        past its deadline), so its agent is forgotten too unless another export needs it."""
        job = self._pending.pop(request_id, None)
        if job is not None:
            self._dropped(job.target.agent_name, forget=caller_gone)

    def _dropped(self, peer: str, forget: bool) -> None:
        self.totals.dropped += 1
        if forget:
            self._forget_if_idle(peer)
        else:
            self._forget_later(peer)

    def _forget_if_idle(self, peer: str) -> None:
        """Drop a decode side's metadata and connection when no export waits for it and no
        write to it is under way (a live one is loaded again by its next export)."""
        if self._writing[peer] or any(j.target.agent_name == peer for j in self._pending.values()):
            return  # the export that ends last arms the timer again
        del self._writing[peer]
        if (timer := self._idle.pop(peer, None)) is not None:
            timer.cancel()
        if peer in self.agent.peers:
            self.agent.forget(peer)
            log.info("NIXL peer %s forgotten", peer)

    def waits_for(self, request_id: str) -> bool:
        """Whether an export waits for this request's release."""
        return request_id in self._pending

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def writes(self) -> int:
        return sum(self._writing.values())

    def close(self) -> None:
        for timer in self._idle.values():
            timer.cancel()
        self._idle.clear()
        for job in self._pending.values():
            job.done.cancel()
        self._pending.clear()
        self._threads.shutdown(wait=True)  # a write still under way ends before the agent does
        self.agent.close()
