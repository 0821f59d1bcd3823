"""The model's attention glue to its KV backend, apart from the layers' math (model.py), as vLLM
and SGLang keep an attention backend apart from their model files. Per layer: the new rows and
index keys go to the backend (`store`); the indexer's scores, the top-k and the backend's rows
for it (`select` in decode, plus the swap-in; `gather` in a prefill chunk); then sparse MLA over
those rows (`attend`), in micro-batches when the backend overlaps its miss copies."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_client.kv.backend import AttnRows, KVBackend
from engine_client.model.forward_batch import PrefillChunk, Tokens
from engine_client.model.preset import ModelConfig
from engine_client.model.workspace import Workspace

# Benchmarks: fn(layer, req_slots, seq_lens, topk) overwriting a decode step's top-k [n, k] in
# place (graph-safe), e.g. a replayed trace (bench/shared/trace.py).
TopkSource = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
# The attention's queries of a layer, (q_abs [n, H, 512], q_pe [n, H, 64]): launched when called.
Queries = Callable[[], tuple[torch.Tensor, ...]]


def row_parts(n: int, m: int, g: int = 1) -> list[slice]:
    """Rows [0, n) cut into at most m contiguous, non-empty, near-equal parts of whole groups
    of g rows (a request's rows stay in one part: they share one swap-in). Python ints of the
    batch's shape only, so a captured graph's parts are fixed by its bucket."""
    bounds = [(n // g) * j // m * g for j in range(m + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class SparseAttention:
    """A model's attention over its backend: what every layer appends, selects and attends."""

    def __init__(self, cfg: ModelConfig, backend: KVBackend) -> None:
        self.cfg, self.backend, self.kernels = cfg, backend, backend.kernels

    def store(self, i: int, rows: torch.Tensor, index_keys: torch.Tensor, tok: Tokens) -> None:
        """Layer i's new KV rows [n, 576] and index keys [n, 128] (bf16; the backend encodes
        them as its layout's formats say)."""
        be = self.backend
        keys = be.layout.index.encode(index_keys)
        be.append(i, rows, keys, tok.req_slots, tok.positions, tok.append_lens)

    def attend(
        self,
        i: int,
        queries: Queries,
        index_q: tuple[torch.Tensor, torch.Tensor],
        tok: Tokens,
        ws: Workspace,
        prefill: PrefillChunk | None,
        topk_source: TopkSource | None = None,
        after_part: Callable[[int], None] | None = None,
    ) -> None:
        """Sparse attention over each part's top-k rows into ws.attn_out. queries() is called
        once every part is planned (Model.late_queries launches their GEMMs there, beside the
        miss copies). after_part(stop), if given, runs once each part's attention is launched:
        rows [0, stop) are then attended (the model's part tail, engine_client.model.part_tail)."""
        be, iq, iw = self.backend, *index_q
        # Decode micro-batches (backend.microbatches > 1): every part is scored and planned
        # before any is attended, so a part's miss copy (the backend's side stream) overlaps
        # the next part's indexer, top-k and plan and the previous part's attention.
        overlap = prefill is None and be.microbatches > 1
        parts = row_parts(iq.shape[0], be.microbatches if overlap else 1, tok.rows_per_request)
        sels = [self._select(i, r, iq, iw, tok, ws, prefill, topk_source) for r in parts]
        q_abs, q_pe = queries()
        for r, sel in zip(parts, sels):
            if overlap:
                # Every part, a lone one too (a batch of 1 has one part): this joins the part's
                # side-stream copy into the main stream, which a graph capture requires of
                # every stream it forked ("capturing stream has unjoined work" otherwise).
                be.attention_ready(r.start)
            self._mla(q_abs[r], q_pe[r], sel, ws, r)
            if after_part is not None:
                after_part(r.stop)

    def _mla(
        self, q_abs: torch.Tensor, q_pe: torch.Tensor, sel: AttnRows, ws: Workspace, r: slice
    ) -> None:
        """Sparse MLA of batch rows r over their selected rows into ws.attn_out[r]."""
        # Only a layout with host reads passes the host tier: other kernels keep their signature.
        host = {} if sel.host is None else {"host": sel.host}
        self.kernels.sparse_mla_decode(
            q_abs,
            q_pe,
            sel.kv,
            sel.row_base,
            sel.slots,
            self.cfg.softmax_scale,
            ws.attn_out[r],
            ws.lse[r],
            row_format=self.backend.layout.row,
            workspace=ws.attn_scratch,
            **host,
        )

    def _select(
        self,
        i: int,
        r: slice,
        iq: torch.Tensor,
        iw: torch.Tensor,
        tok: Tokens,
        ws: Workspace,
        prefill: PrefillChunk | None,
        topk_source: TopkSource | None,
    ) -> AttnRows:
        """Indexer scores, top-k and the backend's rows for batch rows r."""
        be, slots, lens = self.backend, tok.req_slots[r], tok.seq_lens[r]
        be.index_scores(i, iq[r], iw[r], slots, lens, ws.scores[r])
        self.kernels.topk_select(ws.scores[r], lens, ws.topk[r], workspace=ws.topk_scratch)
        if prefill is not None:
            return be.gather(i, ws.topk[r], prefill.req_slot, prefill.seq_len)
        if topk_source is not None:
            topk_source(i, slots, lens, ws.topk[r])
        # Top-k is causal per row (< seq_len); the plan's window follows append_lens.
        return be.select(
            i,
            ws.topk[r],
            slots,
            tok.append_lens[r],
            row0=r.start,
            rows_per_request=tok.rows_per_request,
        )
