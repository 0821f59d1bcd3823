"""The batch builder (`BatchBuilder`): turns the admitted requests into one step's `Batch`.

The scheduler decides who runs (queue, admission, expiry); this decides what each of them runs
this step: the next prefill chunks, in queue order, while their tokens fit one prefill chunk
(engine_client.loop.batch.PrefillBudget), and one decode row (D + 1 rows, speculative) for every
running request that still has tokens to produce, at most `max_batch`.

Tokens are counted as *launched* (`GenRequest.launched`): with overlap, step t + 1 is built
before step t's tokens reach the host, so a decode row does not know its input token. The row
then names it -1 and the device reads the slot's last sampled token
(engine_client.model.model_runner).

A speculative step yields 1 to D + 1 tokens per request, known only once it is done: it counts
as one launched token, and the post-processing adds the rest (`Postprocessor`), so `launched`
is a lower bound while a step is in flight, exact once none is. A request whose count is not
exact names its position -1 too: the device knows it (SpeculativeModelRunner.next_pos). Its
sampled rows' keys are derived on the device from its stream key and the rows' positions
(engine_client.loop.speculative.row_keys).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contract.errors import SharedRowWrite
from engine_client.loop.batch import Batch, PrefillBudget, PrefillChunk
from engine_client.loop.request import GenRequest, Phase
from engine_client.loop.sampler import stream_key, token_key
from engine_client.loop.synthetic import SyntheticContext


class BatchBuilder:
    """Builds a step's batch; marks each request it schedules (prefilled, launched, last_step)."""

    def __init__(
        self,
        max_batch: int,
        prefill_chunk: int,
        synthetic: SyntheticContext,
        draft_tokens: int,
        clock: Callable[[], float],
    ) -> None:
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.synthetic, self.draft_tokens, self.clock = synthetic, draft_tokens, clock

    def build(self, live: Sequence[GenRequest], step: int) -> Batch | None:
        """Step `step`'s batch of the unfinished requests `live` (queue order), None if idle."""
        prefill = [r for r in live if r.phase is Phase.PREFILL]
        decode = [r for r in live if r.phase is Phase.RUNNING and r.launched < r.max_new_tokens][
            : self.max_batch
        ]
        if not prefill and not decode:
            return None
        batch = Batch(step, rows_per_request=self.draft_tokens + 1)
        budget = PrefillBudget(self.prefill_chunk)
        for req in prefill:  # queue order; one that does not fit waits with those behind it
            chunk = self._next_chunk(req)
            if not budget.take(chunk):
                break
            self._add_prefill(batch, chunk)
        for req in decode:
            self._add_decode(batch, req)
        if any(r.sampling.temperature > 0 for r in decode):
            rows = range(batch.rows_per_request)
            batch.temps = [r.sampling.temperature for r in decode for _ in rows]
            keys = [self._key(r) if r.sampling.temperature else 0 for r in decode]
            batch.keys = [k for k in keys for _ in rows]
        return batch

    def _key(self, req: GenRequest) -> int:
        """A decode row's key: the token it yields is the request's launched - 1st; a
        speculative request's stream key, which the device turns into its rows' keys."""
        if self.draft_tokens:
            return stream_key(req.sampling.seed)
        return token_key(req.sampling.seed, req.launched - 1)

    def _next_chunk(self, req: GenRequest) -> PrefillChunk:
        """The request's next prefill chunk (nothing changes until it is added)."""
        start = req.prefilled
        synthetic: tuple[tuple[int, int, int], ...] = ()
        if start < self.synthetic.tokens:
            synthetic = self.synthetic.regions(start, req.prompt)
            start = self.synthetic.tokens
        if start < req.cached_tokens:
            # Positions below cached_tokens live in shared pages that no request may write.
            raise SharedRowWrite(
                f"request {req.request_id}: prefill from {start} would write its cached prefix "
                f"[0, {req.cached_tokens})",
                request_id=req.request_id,
                cached_tokens=req.cached_tokens,
            )
        # Chunks end at multiples of the chunk size (absolute positions): a request whose
        # prefix was cached prefills the same chunks, in the same shapes, as one computing it.
        chunk = self.prefill_chunk
        end = min((start // chunk + 1) * chunk, req.context_len)
        first = None
        if end == req.context_len:
            first = (req.sampling.temperature, token_key(req.sampling.seed, req.replayed))
        return PrefillChunk(req, start, end, synthetic, first)

    def _add_prefill(self, batch: Batch, chunk: PrefillChunk) -> None:
        req = chunk.req
        batch.prefills.append(chunk)
        req.prefilled, req.last_step = chunk.end, batch.step
        req.prefill_at = req.prefill_at or self.clock()
        if chunk.first is not None:
            req.phase, req.launched = Phase.RUNNING, req.replayed + 1

    def _add_decode(self, batch: Batch, req: GenRequest) -> None:
        # The row appends the newest token: known on the host only once it was delivered.
        known = len(req.tokens) == req.launched
        batch.ids.append(req.tokens[-1] if known else -1)
        position = req.prompt_len + req.launched - 1
        batch.positions.append(position if known or not self.draft_tokens else -1)
        batch.slots.append(req.slot)
        batch.decode.append(req)
        req.launched += 1
        req.last_step = batch.step
