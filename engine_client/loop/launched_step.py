"""A launched engine step (`LaunchedStep`, from engine_client.loop.step_runner) and what it
produced once done (`StepOutput`): `wait` blocks on the step's end event only, then reads the
pinned host buffers its tokens, speculative results and swap counters were copied into."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_client.loop.batch import MAX_PREFILLS_PER_STEP, Batch
from engine_client.loop.step_buffers import StepBuffers


@dataclass(frozen=True)
class StepOutput:
    """What one step produced, on the host. decode_tokens[i] belongs to batch.decode[i]: the
    tokens its row(s) yielded (one; a verify step's accepted drafts and the token after them);
    prefill_tokens[i]: the first token of batch.prefills[i]'s request if that chunk ended its
    prompt, else None; prefill_drafts[i]: then, in a speculative engine, the MTP layer's drafts
    after it (else empty);
    positions[i]: the position batch.decode[i]'s (first) row ran at;
    drafted[i] / accepted[i]: its drafts checked / taken (speculative steps, else empty);
    per_slot[r] = (top-k positions selected, misses, misses summed over rows) of request slot r
    in this step (the last differs from misses when a verify step's rows shared a swap-in);
    device_seconds: the step's busy time on the device; idle_before: device idle time between
    the previous step and this one (None after the engine was idle); decode_seconds: the part of
    device_seconds after the prefill chunks (what the decode rows cost, for the admission limit)."""

    batch: Batch
    decode_tokens: list[list[int]]
    prefill_tokens: list[int | None]
    per_slot: list[tuple[int, int, int]]
    device_seconds: float
    idle_before: float | None
    positions: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    prefill_drafts: list[tuple[int, ...]] = field(default_factory=list)


class LaunchedStep:
    def __init__(self, batch: Batch, bufs: StepBuffers, previous: "LaunchedStep | None") -> None:
        self.batch, self.bufs, self.previous = batch, bufs, previous

    @property
    def launch_seconds(self) -> float:
        """Host time spent launching (on CPU: computing) the step."""
        return self.bufs.cpu_end - self.bufs.cpu_start

    def _times(self) -> tuple[float, float, float | None]:
        """Block until the step has finished on the device; its busy, decode and idle-before
        seconds."""
        b, prev = self.bufs, self.previous
        self.previous = None  # only the idle gap needed it
        if b.end is None:
            idle = b.cpu_start - prev.bufs.cpu_end if prev is not None else None
            return b.cpu_end - b.cpu_start, b.cpu_end - b.cpu_decode, idle
        # On CUDA every step has all three events, elsewhere none.
        assert b.start is not None and b.decode is not None
        b.end.synchronize()
        prev_end = prev.bufs.end if prev is not None else None
        idle = prev_end.elapsed_time(b.start) / 1e3 if prev_end is not None else None
        return b.start.elapsed_time(b.end) / 1e3, b.decode.elapsed_time(b.end) / 1e3, idle

    def wait(self) -> StepOutput:
        """Block until the step has finished on the device; its results (no other sync)."""
        b, batch = self.bufs, self.batch
        busy, decode, idle = self._times()
        n, G = len(batch.decode), batch.rows_per_request
        rows = b.tokens[: n * G].tolist()
        firsts = b.tokens[-MAX_PREFILLS_PER_STEP:].tolist()
        first = [firsts[i] if c.first is not None else None for i, c in enumerate(batch.prefills)]
        drafts: list[tuple[int, ...]] = []
        if b.first_drafts is not None and batch.ends_a_prompt:  # copied by the step runner then
            drafts = [tuple(d) for d in b.first_drafts.tolist()]
        prefill_drafts = [
            drafts[i] if t is not None and drafts else () for i, t in enumerate(first)
        ]
        per_slot = [(s, m, rm) for s, m, rm in b.counts.tolist()]
        if G == 1:
            tokens, drafted, accepted = [[t] for t in rows], [], []
            positions = batch.positions
        else:
            accepted, drafted, positions = (x[:n] for x in b.spec.tolist())
            tokens = [rows[i * G : i * G + a + 1] for i, a in enumerate(accepted)]
        return StepOutput(
            batch,
            tokens,
            first,
            per_slot,
            busy,
            idle,
            positions,
            drafted,
            accepted,
            decode,
            prefill_drafts,
        )
