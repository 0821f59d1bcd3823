"""V3.2's multi-token-prediction (MTP) layer, the draft module of speculative decoding.

The layer (checkpoint layer `num_layers`, ModelConfig.mtp_layers = 1) proposes the token two
ahead: at position i it takes the target's last-layer output h_i (before the final norm) and
the embedding of the token at i + 1,
    x = eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)]),
runs one decoder block on KV layer `num_layers` of the backend (its own KV rows and index keys,
stored, swapped in and attended like any layer's: sparse attention over its own top-k), then
shared_head.norm and the model's own output head; the draft is the argmax. D drafts chain it:
the next pass takes the layer's own output in place of h (as SGLang's MTP drafting does).

Drafts are greedy: speculative sampling against a one-hot draft distribution keeps the target's
distribution exactly (engine_client.loop.speculative). Positions and rollback: the layer writes
KV rows at positions a verify step may reject; the next step rewrites them before any read, as
for the target's layers (engine_client.model.speculative_runner explains the window rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_client.model.forward_batch import PrefillChunk, Tokens
from engine_client.model.model import Model
from engine_client.model.workspace import Workspace


def draft_states(
    model: Model,
    tok: Tokens,
    hidden: torch.Tensor,
    ws: Workspace,
    prefill: PrefillChunk | None = None,
) -> torch.Tensor:
    """The MTP layer's output [n, hidden] (before shared_head.norm): tok.ids are the tokens at
    positions + 1, hidden [n, hidden] the target's (or the previous pass's) states."""
    lw = model.mtp
    assert lw is not None, "the model has no MTP layer (ModelConfig.mtp_layers = 0)"
    e = model.norm(F.embedding(tok.ids, model.embed), lw["enorm.weight"])
    h = model.norm(hidden, lw["hnorm.weight"])
    x = model.linear(torch.cat((e, h), dim=-1), lw["eh_proj.weight"])
    cos, sin = model.rope.lookup(tok.positions)
    return model.block(model.cfg.num_layers, lw, x, cos, sin, tok, ws, prefill)


def draft_tokens(model: Model, x: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [n] int64 of MTP outputs x [n, hidden], through the shared output head."""
    assert model.mtp is not None
    h = model.norm(x, model.mtp["shared_head.norm.weight"])
    return model.logits(h).argmax(dim=-1)


def draft_chain(
    model: Model,
    req_slots: torch.Tensor,
    position: torch.Tensor,
    x: torch.Tensor,
    high_water: torch.Tensor,
    ws: Workspace,
    out: torch.Tensor,
) -> None:
    """D = out.shape[1] drafts per request into out [n, D]: the first from the MTP output x
    [n, hidden] of the row at `position` [n] int32, the others by chaining the layer at
    positions + 1, + 2, ... (1 row per request). high_water [n]: the longest length the
    request's KV layer reached this step; each pass's append length is at least that, so the
    window ring is never trusted for a token a rejected row overwrote."""
    live = req_slots >= 0
    d = draft_tokens(model, x)
    out[:, 0] = d
    for k in range(1, out.shape[1]):
        position = position + 1
        lens = torch.where(live, position + 1, 0)
        tok = Tokens(d, req_slots, position, lens, torch.maximum(high_water, lens))
        x = draft_states(model, tok, x, ws)
        d = draft_tokens(model, x)
        out[:, k] = d


def draft_prefill(
    model: Model, req_slot: int, next_ids: torch.Tensor, states: torch.Tensor, start: int
) -> torch.Tensor:
    """The MTP layer over one prefill chunk at positions [start, start + n): next_ids [n] the
    tokens at positions + 1, states [n, hidden] the target's. Writes the layer's KV rows and
    keys; returns its outputs [n, hidden]."""
    tok, ws = model.chunk(req_slot, next_ids, start)
    prefill = PrefillChunk(req_slot, start + next_ids.shape[0])
    return draft_states(model, tok, states, ws, prefill)
