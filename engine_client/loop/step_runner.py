"""The step runner (`StepRunner`, held as `Engine.step_runner`): launches one engine step on the
device, through the compute's model runner, and hands its results back later.

`launch(batch)` enqueues the step and returns at once on a GPU: the prefill chunks (if any), the
decode graph, sampling on the device (engine_client.loop.sampler), the sampled tokens written
back as the slots' last tokens for the next step, and an asynchronous copy of the tokens and
swap counters into one of three pinned host buffers, followed by an event. `LaunchedStep.wait()`
waits for that event only, then reads the pinned buffer.

Overlap (`advance`): launch step t, then wait for step t - 1. The device runs t while the host
post-processes t - 1 and schedules t + 1, so it never waits for the host. Without overlap the
step runner waits for the step it just launched. On CPU the device is synchronous: launch computes
the step and the events are absent, but the code path is the same.

Three buffer sets (engine_client.loop.step_buffers), because when step t + 1 is launched, step
t's buffers are not read yet and step t - 1's end event is still needed for step t's idle gap.

A speculative step accepts drafts on the device (engine_client.loop.speculative), or by the
BENCHMARK-ONLY synthetic rule (engine_client.loop.synthetic_acceptance) when `acceptance` is set.
It overlaps like a plain step: its positions and its sampled rows' keys come from the device
where the host does not know them yet (SpeculativeModelRunner.next_pos, speculative.row_keys),
and the positions it ran at come back with its tokens (`StepOutput.positions`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine_client.loop.acceptance_rates import AcceptanceRates
from engine_client.loop.batch import MAX_PREFILLS_PER_STEP, Batch, PrefillChunk
from engine_client.loop.launched_step import LaunchedStep, StepOutput
from engine_client.loop.request import GenRequest
from engine_client.loop.sampler import sample_rows
from engine_client.loop.speculative import row_keys, verify
from engine_client.loop.step_buffers import StepBuffers
from engine_client.loop.synthetic_acceptance import SyntheticAcceptance
from engine_client.model.compute import Compute
from engine_client.model.progress import Progress
from engine_client.model.speculative_runner import SpeculativeModelRunner

BUFFER_SETS = 3
# Tokens per chunk of a synthetic context fill (KVBackend.fill_synthetic), a progress step.
SYNTHETIC_CHUNK = 4096


@dataclass(frozen=True)
class Advance:
    """One turn of the step runner: the step now in flight, the results of a finished one, and the
    error of a step that could not be launched (its work has drained from the device)."""

    launched: LaunchedStep | None
    done: StepOutput | None
    error: Exception | None = None


class StepRunner:
    def __init__(
        self, compute: Compute, *, overlap: bool, acceptance: AcceptanceRates | None = None
    ) -> None:
        """acceptance: speculative steps accept by the BENCHMARK-ONLY synthetic rule."""
        self.compute, self.overlap, self.acceptance = compute, overlap, acceptance
        self._synthetic: SyntheticAcceptance | None = None
        self.cuda = compute.model.device.type == "cuda"
        self._out: torch.Tensor | None = None
        self._bufs: list[StepBuffers] = []
        self._last: LaunchedStep | None = None
        self._launches = 0

    def _allocate(self) -> None:
        """On the compute thread, at the first launch: CUDA work stays on that thread."""
        m, dev = self.compute.max_batch, self.compute.model.device
        rows = m * (self.compute.draft_tokens + 1)
        # Rows [0, rows): decode (D + 1 per request in speculative steps); then one per prefill
        # chunk of the step: its request's first token.
        total = rows + MAX_PREFILLS_PER_STEP
        self._out = torch.zeros(total, dtype=torch.int64, device=dev)
        # Speculative steps: accepted, drafted and first position per request; the drafts a
        # prompt's last chunk made, per prefill chunk (a prefill engine sends them on).
        self._spec = torch.zeros((3, m), dtype=torch.int64, device=dev)
        drafts = (MAX_PREFILLS_PER_STEP, self.compute.draft_tokens)
        self._first_drafts = torch.full(drafts, -1, dtype=torch.int64, device=dev)
        self._temps = torch.zeros(total, dtype=torch.float32, device=dev)
        self._keys = torch.zeros(total, dtype=torch.int64, device=dev)
        slots = self.compute.backend.max_requests
        self._bufs = [StepBuffers(total, m, slots, self.cuda, drafts) for _ in range(BUFFER_SETS)]
        if self.acceptance is not None:
            self._synthetic = SyntheticAcceptance(self.acceptance, slots, dev)

    @property
    def _tokens(self) -> torch.Tensor:
        """The step's sampled tokens on the device (allocated at the first launch)."""
        assert self._out is not None, "read before the first launch"
        return self._out

    def idle(self) -> None:
        """The engine waited for work: the next step's idle gap is not the device's fault."""
        self._last = None

    def advance(self, batch: Batch | None, inflight: LaunchedStep | None) -> Advance:
        """Launch `batch`, then wait for `inflight` (overlap) or for `batch` itself."""
        launched = error = None
        if batch is not None:
            try:
                launched = self.launch(batch)
            except Exception as e:  # noqa: BLE001 - handed to the engine with its batch
                self.synchronize()  # whatever it enqueued is done before its requests are freed
                self._last, error = None, e
        if not self.overlap and launched is not None:
            return Advance(None, launched.wait(), error)
        return Advance(launched, inflight.wait() if inflight is not None else None, error)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def launch(self, batch: Batch) -> LaunchedStep:
        if self._out is None:
            self._allocate()
        bufs = self._bufs[self._launches % BUFFER_SETS]
        self._launches += 1
        bufs.cpu_start = time.perf_counter()
        if bufs.start is not None:
            bufs.start.record()
        for i, chunk in enumerate(batch.prefills):
            self._prefill(chunk, bufs, i)
        if bufs.decode is not None:
            bufs.decode.record()
        bufs.cpu_decode = time.perf_counter()
        if batch.decode:
            self._decode(batch, bufs)
        counts = self.compute.backend.counts
        bufs.tokens.copy_(self._tokens, non_blocking=True)
        bufs.spec.copy_(self._spec, non_blocking=True)
        if bufs.first_drafts is not None and batch.ends_a_prompt:  # else never read
            bufs.first_drafts.copy_(self._first_drafts, non_blocking=True)
        bufs.counts.copy_(counts, non_blocking=True)
        counts.zero_()
        if bufs.end is not None:
            bufs.end.record()
        bufs.cpu_end = time.perf_counter()
        step = LaunchedStep(batch, bufs, self._last)
        self._last = step
        return step

    def _sampling(
        self, bufs: StepBuffers, temps: list[float] | None, keys: list[int] | None, start: int
    ):
        """Device views of the rows' temperatures and keys, staged through pinned memory."""
        if temps is None:
            return None, None
        end = start + len(temps)
        bufs.temps[start:end] = torch.tensor(temps, dtype=torch.float32)
        bufs.keys[start:end] = torch.tensor(keys, dtype=torch.int64)
        self._temps[start:end].copy_(bufs.temps[start:end], non_blocking=True)
        self._keys[start:end].copy_(bufs.keys[start:end], non_blocking=True)
        return self._temps[start:end], self._keys[start:end]

    def _prefill(self, chunk: PrefillChunk, bufs: StepBuffers, i: int) -> None:
        """The step's prefill chunk i; a chunk that ends its prompt samples the first token into
        row i of the prefill rows (after the decode rows)."""
        c, req, start, end = self.compute, chunk.req, chunk.start, chunk.end
        row = self._tokens.shape[0] - MAX_PREFILLS_PER_STEP + i
        if chunk.synthetic:
            self._fill_synthetic(req, chunk.synthetic)
        states = c.model.prefill_states(
            req.slot, req.context[start:end], start=start, chunk_size=end - start
        )
        logits = c.model.logits(c.model.final(states[-1:]))[0]
        token = None
        if chunk.first is not None:
            temp, key = chunk.first
            temps, keys = self._sampling(bufs, [temp], [key], row) if temp else (None, None)
            token = sample_rows(logits[None], temps, keys)
            self._tokens[row : row + 1].copy_(token)
            c.model_runner.remember_slot(req.slot, token)
        if c.draft_tokens:
            self._prefill_drafts(chunk, states, token, i)

    def _fill_synthetic(self, req: GenRequest, regions: tuple[tuple[int, int, int], ...]) -> None:
        be = self.compute.model.backend
        chunks = be.num_layers * sum(-(-(b - a) // SYNTHETIC_CHUNK) for a, b, _ in regions)
        what = f"synthetic context ({regions[-1][1]} tokens) of {req.request_id[:8]}"
        with Progress(what, chunks, "chunk") as progress:
            for first, last, seed in regions:
                be.fill_synthetic(
                    req.slot,
                    last,
                    seed=seed,
                    start=first,
                    chunk=SYNTHETIC_CHUNK,
                    progress=progress.update,
                )

    def _prefill_drafts(
        self, chunk: PrefillChunk, states: torch.Tensor, token: torch.Tensor | None, i: int
    ) -> None:
        """The MTP layer over the step's prefill chunk i: each position with the token after it
        (the prompt's, the sampled first token after the last); the last chunk also drafts the
        first step, and copies those drafts out with the step's tokens (a prefill engine sends
        them to its decode side)."""
        req, start, end = chunk.req, chunk.start, chunk.end
        model_runner = self.compute.model_runner
        assert isinstance(model_runner, SpeculativeModelRunner)
        # The context: a revived request's prefill re-creates its replayed tokens too.
        after = torch.tensor(req.context[start + 1 : end + 1], dtype=torch.int64)
        following = after.to(model_runner.device)
        if token is not None:
            following = torch.cat((following, token.view(1)))
        model_runner.prefill_drafts(req.slot, following, states, start, last=token is not None)
        if token is None:
            return
        self._first_drafts[i].copy_(model_runner.drafts[req.slot])
        if self._synthetic is not None:
            self._synthetic.start(req.slot, req.prompt, req.sampling.seed)

    def _decode(self, batch: Batch, bufs: StepBuffers) -> None:
        if self.compute.draft_tokens:
            self._verify(batch, bufs)
            return
        c, n = self.compute, len(batch.decode)
        logits = c.model_runner.step(
            batch.ids, batch.positions, batch.slots, [p + 1 for p in batch.positions]
        )
        tokens = sample_rows(logits, *self._sampling(bufs, batch.temps, batch.keys, 0))
        self._tokens[:n].copy_(tokens)
        c.model_runner.remember(tokens, n)

    def _verify(self, batch: Batch, bufs: StepBuffers) -> None:
        """A speculative step: verify each request's drafts, accept on the device, draft on."""
        model_runner, n = self.compute.model_runner, len(batch.decode)
        assert isinstance(model_runner, SpeculativeModelRunner)
        G = model_runner.rows_per_request
        self._land_peer_drafts(batch.decode, model_runner)
        logits = model_runner.step(batch.ids, batch.positions, batch.slots)
        drafts = model_runner.step_drafts[:n]
        slots, base = model_runner.staged(n)
        temps, keys = self._sampling(bufs, batch.temps, batch.keys, 0)
        if keys is not None:  # staged: the requests' stream keys
            keys = row_keys(keys, base, G)
        if self._synthetic is None:
            y, accepted = verify(logits, drafts, temps, keys)
        else:
            y, accepted = self._synthetic.verify(logits, drafts, slots, base, temps, keys)
        model_runner.draft(y, accepted)
        self._tokens[: n * G].copy_(y.view(-1))
        self._spec[0, :n].copy_(accepted)
        self._spec[1, :n].copy_((drafts >= 0).sum(dim=1))
        self._spec[2, :n].copy_(base)

    def _land_peer_drafts(
        self, requests: list[GenRequest], model_runner: SpeculativeModelRunner
    ) -> None:
        """Requests a prefill peer prefilled (engine_client.loop.remote_prefill): the peer's
        drafts go into the slot before their first verify step, with the synthetic rule's key,
        as a local last prefill chunk leaves them. The first D are taken, -1 past what the peer
        drafted (a -1 draft is never accepted: that step then decodes one token)."""
        D = model_runner.D
        for req in requests:
            if req.peer_drafts is None:
                continue
            drafts = (list(req.peer_drafts) + [-1] * D)[:D]
            model_runner.drafts[req.slot].copy_(torch.tensor(drafts, dtype=torch.int64))
            if self._synthetic is not None:
                self._synthetic.start(req.slot, req.prompt, req.sampling.seed)
            req.peer_drafts = None
