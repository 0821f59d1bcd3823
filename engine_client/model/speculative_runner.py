"""The speculative model runner: verify D drafts per request, then draft the next D, on static
buffers with CUDA graphs per batch bucket (engine_client.model.model_runner's conventions).

Speculative decoding, where each part lives: this runner (the verify and draft graphs, the
drafts of a prefill), the draft module (`engine_client.model.mtp`, V3.2's MTP layer), the
acceptance on the device (`engine_client.loop.speculative`, beside the sampler it builds on),
and the step loop's dispatch to it (`engine_client.loop.step_runner`).

A verify step of a request whose last accepted token sits at position p (its KV not stored
yet) runs the model over D + 1 consecutive rows: the token at p and the drafts for p + 1 ..
p + D, each row a batch row of its own (its own top-k, its own attention) that shares one
swap-in with the request's other rows (Tokens.rows_per_request). The caller turns the logits
into the target's tokens y and the accepted count a (engine_client.loop.speculative); `draft`
then runs the MTP layer (engine_client.model.mtp) over the same positions with the target's
tokens (the layer's own KV rows, and the proposal after row a), chains it D - 1 times, and
leaves y[a] and the new drafts in `last_token` / `drafts` for the next step.

Overlap. The draft graph also moves the slot's `next_pos` to p + a + 1, so the next step,
staged with position -1, starts there: the engine launches it before this step's tokens
reach the host (engine_client.loop.batch_builder), as it does plain steps.

Rollback. The request's stored length becomes p + a + 1; nothing is undone on the device:
- KV rows, index keys and host-tier rows at rejected positions > p + a are rewritten by the
  next step's appends of the same positions, which run (per layer) before any read of them;
- the window ring: a row at position q overwrites ring slot q % W, the slot of token q - W,
  which a shorter row of the same request (or, after the rollback, the next step) would
  otherwise count as inside its window. So every append and plan of a request uses as its
  length the longest any of its rows reached (Tokens.append_lens: p + D + 1 on every row, and
  at least that in the draft chain). Lengths only grow between steps, so a token is trusted in
  the ring only while its slot holds its newest write; older tokens are LRU hits or misses read
  from the host tier, which rejected rows never write for them;
- the LRU slots: with W >= D + 1 (KVLayout.check_draft_tokens) every row's own token is in the
  window when it is written, so a rejected position never enters token_slot; what the plans
  of rejected rows brought in are accepted older tokens, kept like any other (the LRU state is
  the oracle's over the unions, rejected rows included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_client.model.forward_batch import Tokens
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.mtp import draft_chain, draft_prefill, draft_states

_IDS, _SLOTS, _POS = 0, 1, 2


class SpeculativeModelRunner(ModelRunner):
    """Verify + draft steps of D = draft_tokens drafts. `step` runs the verify rows and returns
    their logits [n (D + 1), vocab]; `draft` takes the accepted result. Device state per
    request slot (entry R: padding rows): last_token (the token at the next step's first
    position), next_pos (that position) and drafts [R + 1, D] int64 (-1: none, never
    accepted). The draft graph moves next_pos on by the accepted count, so a step staged with
    position -1 starts where the step before it ended without the host knowing where: the
    engine launches step t + 1 before step t's tokens reach the host (overlap)."""

    def __init__(self, model: Model, cfg: DecodeConfig, draft_tokens: int) -> None:
        if model.mtp is None or draft_tokens < 1:
            raise ValueError("speculative steps need the model's MTP layer and >= 1 draft")
        self.D = draft_tokens
        super().__init__(model, cfg, rows_per_request=draft_tokens + 1)
        m, G, dev, R = cfg.max_batch, draft_tokens + 1, self.device, model.backend.max_requests
        self.drafts = torch.full((R + 1, self.D), -1, dtype=torch.int64, device=dev)
        self.next_pos = torch.zeros(R + 1, dtype=torch.int32, device=dev)
        # The step's first positions as run: staged, or a slot's next_pos where staged -1.
        self.base = torch.zeros(m, dtype=torch.int32, device=dev)
        # Static buffers of the two graphs: the verify rows' states and drafts, then the
        # accepted result the draft graph reads and the drafts it writes.
        self.hidden = torch.zeros(
            (m * G, model.cfg.hidden_size), dtype=model.embed.dtype, device=dev
        )
        self.step_drafts = torch.full((m, self.D), -1, dtype=torch.int64, device=dev)
        self.verified = torch.zeros((m, G), dtype=torch.int64, device=dev)
        self.accepted = torch.zeros((m,), dtype=torch.int64, device=dev)
        self.next_drafts = torch.full((m, self.D), -1, dtype=torch.int64, device=dev)
        self.draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _rows(self, slots: torch.Tensor, base: torch.Tensor, ids: torch.Tensor) -> Tokens:
        """The D + 1 rows of each request at positions base + j, appended as one request whose
        length is base + D + 1 (padding requests: slot -1, lengths 0)."""
        G = self.rows_per_request
        live = (slots >= 0).repeat_interleave(G)
        pos = (base[:, None] + torch.arange(G, dtype=base.dtype, device=base.device)).view(-1)
        top = (base + G).repeat_interleave(G)
        return Tokens(
            ids=ids,
            req_slots=slots.repeat_interleave(G),
            positions=pos,
            seq_lens=torch.where(live, pos + 1, 0),
            append_lens=torch.where(live, top, 0),
            rows_per_request=G,
        )

    def _pad(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots >= 0, slots, self._pad_slot).long()

    def _body(self, bs: int) -> None:
        """Verify: rows [last token, drafts] of each request -> logits, last-layer states."""
        x, n = self.inputs[:, :bs], bs * self.rows_per_request
        slots, pad = x[_SLOTS], self._pad(x[_SLOTS])
        first = torch.where(x[_IDS] >= 0, x[_IDS], self.last_token[pad]).long()
        base = self.base[:bs]
        base.copy_(torch.where(x[_POS] >= 0, x[_POS], self.next_pos[pad]))
        drafts = self.drafts[pad]
        self.step_drafts[:bs].copy_(drafts)
        ids = torch.cat((first[:, None], drafts.clamp(min=0)), dim=1).view(-1)
        states = self.model.hidden_states(self._rows(slots, base, ids), self.ws.rows(n))
        self.hidden[:n].copy_(states)
        self.model.logits(self.model.final(states), out=self.logits[:n])

    def _draft_body(self, bs: int) -> None:
        """Draft: the MTP layer over the verify positions with the target's tokens, the first
        draft from each request's row a, D - 1 chained passes; then the next step's state."""
        x, G, n = self.inputs[:, :bs], self.rows_per_request, bs * self.rows_per_request
        slots, base, a = x[_SLOTS], self.base[:bs], self.accepted[:bs]
        y = self.verified[:bs]
        states = draft_states(
            self.model, self._rows(slots, base, y.reshape(-1)), self.hidden[:n], self.ws.rows(n)
        )
        row = torch.arange(bs, device=self.device) * G + a
        top = torch.where(slots >= 0, base + G, 0)
        out = self.next_drafts[:bs]
        at = base + a.to(base.dtype)
        draft_chain(self.model, slots, at, states[row], top, self.ws.rows(bs), out)
        pad = self._pad(slots)
        # Padding requests write entry R, whose values stay valid token ids (or -1 drafts).
        self.last_token.index_copy_(0, pad, y.gather(1, a[:, None])[:, 0].to(torch.int32))
        self.drafts.index_copy_(0, pad, out)
        self.next_pos.index_copy_(0, pad, at + 1)

    def _check(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        req_slots: Sequence[int],
        seq_lens: Sequence[int],
    ) -> None:
        """Positions -1 (on the device) are not checked here: admission reserved every row a
        step may reach (engine_client.loop.speculative.reserve_extra)."""
        be = self.model.backend
        self._check_rows(token_ids, req_slots)
        known = [p for p in positions if p != -1]
        if len(positions) != len(req_slots) or known and min(known) < 0:
            raise ValueError("positions must be >= 0, or -1 (the slot's next position)")
        if known and max(known) + self.D >= be.max_context:
            raise ValueError(f"a verify step's rows reach past max_context {be.max_context}")

    def step(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        req_slots: Sequence[int],
        seq_lens: Sequence[int] = (),
    ) -> torch.Tensor:
        """Verify: request i's rows start at positions[i] (-1: the slot's `next_pos`) with
        token_ids[i] (-1: the slot's `last_token`) and continue with its drafts; fp32 logits
        [n (D + 1), vocab] (a view of the static buffer; rows of a request consecutive).
        seq_lens is ignored."""
        return super().step(token_ids, positions, req_slots, [p + 1 for p in positions])

    def staged(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request slots and first positions [n] int32 (device) of the step just run (the
        positions as run: the staged ones, or the slots' next positions)."""
        return self.inputs[_SLOTS, :n], self.base[:n]

    def draft(self, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """After `step`: verified [n, D + 1] int64, the target's token for each row, and
        accepted [n] int64, the drafts taken (0..D); runs the draft graph of the step's bucket."""
        n = verified.shape[0]
        self.verified[:n].copy_(verified)
        self.accepted[:n].copy_(accepted)
        bs = self.cfg.bucket(n)
        with self.on_compute():
            if self.use_graphs:
                self.draft_graphs[bs].replay()
            else:
                self._draft_body(bs)

    def drop_graphs(self) -> None:
        # The draft graphs first: the base class then frees the pool they shared.
        self.draft_graphs.clear()
        super().drop_graphs()

    def _capture_bucket(self, bs: int) -> None:
        super()._capture_bucket(bs)
        self.draft_graphs[bs] = self._graph_of(self._draft_body, bs)

    def prefill_drafts(
        self,
        req_slot: int,
        next_ids: torch.Tensor,
        states: torch.Tensor,
        start: int,
        last: bool = False,
    ) -> None:
        """The MTP layer over a prefill chunk at [start, start + n): next_ids [n] (the prompt
        shifted by one; for the last chunk ending with the first sampled token), states the
        target's. `last` (the prompt's last chunk): also draft the first verify step's tokens."""
        x = draft_prefill(self.model, req_slot, next_ids, states, start)
        if not last:
            return
        end = start + next_ids.shape[0]
        dev = self.device
        slot = torch.tensor([req_slot], dtype=torch.int32, device=dev)
        at = torch.tensor([end - 1], dtype=torch.int32, device=dev)
        out = self.next_drafts[:1]
        draft_chain(self.model, slot, at, x[-1:], at + 1, self.ws.rows(1), out)
        self.drafts[req_slot].copy_(out[0])
        self.next_pos[req_slot] = end  # the first token's position: the first step starts there
