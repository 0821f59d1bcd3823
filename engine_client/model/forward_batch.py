"""The tokens of one forward of the model: a decode batch (one row per request, or a verify
step's D + 1 rows per request) or one request's prefill chunk. The model runners build them,
the layers and the attention glue read them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tokens:
    """One forward's tokens: ids [n] int64; req_slots, positions, seq_lens (causal: pos + 1,
    or 0 on padding rows) and append_lens [n] int32: each request's stored length after this
    append, as far as residency goes (the window ring keeps tokens >= append_len - W; a
    speculative step passes the longest length any row of the request reached, so the ring is
    never trusted for a token a speculative row's append overwrote). rows_per_request G: rows
    [g G, (g + 1) G) are one request's (a verify step's D + 1 rows) and share one swap-in."""

    ids: torch.Tensor
    req_slots: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    append_lens: torch.Tensor
    rows_per_request: int = 1


@dataclass(frozen=True)
class PrefillChunk:
    """Marks a forward as one request's prefill chunk: attention reads through backend.gather.
    seq_len: the request's stored length once the chunk is appended."""

    req_slot: int
    seq_len: int
