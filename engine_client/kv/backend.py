"""The KV backend the model calls at every layer, and the all-on-GPU baseline.

A backend stores new KV rows and indexer keys (`append`), scores the indexer keys
(`index_scores`), and hands attention the rows of a top-k selection as (kv rows, row_base, slots)
(`select` for decode, `gather` for prefill). Attention reads row `row_base[b] + slots[b, i]` of
`kv`, in slot-list order, so every backend that yields the same rows gives bitwise-identical
output. The HiSparse backends (service memory) are in `engine_client.kv.hisparse`.

Tensor conventions: req_slots, positions, seq_lens [n] int32; a row with req_slot -1 is padding
and changes nothing; seq_lens count the stored tokens including the new one.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from contract.layout import KVLayout
from engine_client.kv.kernel_set import KernelSet
from kernels.formats import INDEX_DIM, ROW_VALUES
from kernels.reference import write_index_rows


@dataclass(frozen=True)
class AttnRows:
    """What attention reads: rows kv (as the layout's row format has attention read them:
    `RowFormat.attn_rows`), row_base [n] int64, slots [n, k] int32."""

    kv: torch.Tensor
    row_base: torch.Tensor
    slots: torch.Tensor


class KVBackend(ABC):
    """Where the KV rows and indexer keys of every request slot live."""

    layout: KVLayout
    num_layers: int
    max_requests: int
    max_context: int
    topk: int
    device: torch.device
    kernels: KernelSet
    # The decode path (append, index_scores, select) may be captured in a CUDA graph.
    capturable: bool = True

    @abstractmethod
    def append(
        self,
        layer: int,
        kv_rows: torch.Tensor,
        index_rows: torch.Tensor,
        req_slots: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        """Store rows kv_rows [n, 576] bf16 (encoded here as the layout's row format says) and
        index_rows [n, I] uint8 (`layout.index.encode`) at (req_slot, position).
        seq_lens: each request's stored length once this append is done (the window ring of an
        offloaded request keeps only tokens >= seq_len - W, so pass a chunk's end, not pos + 1)."""

    @abstractmethod
    def index_pool_layer(self, layer: int) -> torch.Tensor:
        """Index keys of `layer` as [pages, P, I] uint8, addressed through `page_table`."""

    @property
    @abstractmethod
    def page_table(self) -> torch.Tensor:
        """[R, pages per request] int32 page ids of the index pool."""

    @abstractmethod
    def select(
        self, layer: int, topk: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor
    ) -> AttnRows:
        """Decode: make the top-k rows of each batch row readable. Graph-safe when capturable."""

    @abstractmethod
    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        """Prefill of one request: the top-k rows of each chunk token (all < seq_len, the
        request's stored length), read from the authoritative store without touching
        residency/LRU state. May synchronize."""

    def index_scores(
        self,
        layer: int,
        q: torch.Tensor,
        w: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """out[b, t] = sum_h w[b, h] relu(q[b, h] . key_t) for t < seq_lens[b], else -inf."""
        self.kernels.indexer_scores(
            q,
            w,
            self.index_pool_layer(layer),
            self.page_table,
            req_slots,
            seq_lens,
            out,
            index_format=self.layout.index,
        )

    def stats(self) -> dict[str, int]:
        """Counters since the last reset (reads the device: call between steps)."""
        return {}

    def fill_synthetic(
        self, req_slot: int, n_tokens: int, *, seed: int = 0, chunk: int = 4096
    ) -> None:
        """Write random KV rows and index keys for positions [0, n_tokens) of `req_slot`, so a
        benchmark starts from a long context without a prefill. Deterministic in (seed, layer,
        chunk start) on a given device type, so every backend stores the same bytes."""
        if (
            not 0 <= req_slot < self.max_requests
            or not 0 < n_tokens <= self.max_context
            or chunk <= 0
        ):
            raise ValueError(
                f"bad synthetic fill: slot {req_slot}, {n_tokens} tokens, chunk {chunk}"
            )
        r = torch.full((chunk,), req_slot, dtype=torch.int32, device=self.device)
        lens = torch.full((chunk,), n_tokens, dtype=torch.int32, device=self.device)
        for layer in range(self.num_layers):
            for start in range(0, n_tokens, chunk):
                m = min(chunk, n_tokens - start)
                gen = torch.Generator(device=self.device)
                gen.manual_seed(zlib.crc32(f"{seed}:{layer}:{start}".encode()))
                rows = torch.randn((m, ROW_VALUES), generator=gen, device=self.device)
                keys = torch.randn((m, INDEX_DIM), generator=gen, device=self.device)
                pos = torch.arange(start, start + m, dtype=torch.int32, device=self.device)
                self.append(
                    layer,
                    rows.to(torch.bfloat16),
                    self.layout.index.encode(keys),
                    r[:m],
                    pos,
                    lens[:m],
                )


def baseline_layout(
    num_layers: int,
    max_requests: int,
    max_context: int,
    topk: int,
    page_size: int = 64,
    **formats: str,
) -> KVLayout:
    """The layout of an all-on-GPU cache: the index pool holds every request's whole context
    (num_pages = R * pages per request); there are no hot buffers, so hot_slots and window are
    only the smallest the layout accepts. `formats`: row_format / index_format."""
    ppr = -(-max_context // page_size)
    return KVLayout(
        num_layers=num_layers,
        max_requests=max_requests,
        hot_slots=topk + 1,
        window=1,
        topk=topk,
        page_size=page_size,
        num_pages=max_requests * ppr,
        max_context=max_context,
        **formats,
    )


def baseline_cache_bytes(layout: KVLayout) -> int:
    """Device bytes of an all-on-GPU cache: every request's whole context, rows and keys."""
    per_token = layout.row_bytes + layout.index_bytes
    pages = layout.max_requests * layout.max_pages_per_request
    return layout.num_layers * pages * layout.page_size * per_token


class BaselineBackend(KVBackend):
    """All KV on the device: a full cache [L, R, C] of rows as attention reads them (stored
    bytes encoded by the same kernels as the HiSparse appends) and an index-key pool with a
    fixed page table (request r owns pages [r * ppr, (r + 1) * ppr)). One extra row per layer
    of each (the last) absorbs the writes of padding rows, so appends need no data-dependent
    branch and stay graph-safe. Of the layout it uses the sizes and formats, not the hot
    buffers (`baseline_layout` makes one)."""

    def __init__(
        self, layout: KVLayout, *, kernels: KernelSet, device: torch.device | str = "cpu"
    ) -> None:
        self.layout = layout
        self.kernels = kernels
        self.device = torch.device(device)
        self.num_layers, self.max_requests = layout.num_layers, layout.max_requests
        self.max_context, self.topk = layout.max_context, layout.topk
        L, R, C, P, ppr = (
            layout.num_layers,
            layout.max_requests,
            layout.max_context,
            layout.page_size,
            layout.max_pages_per_request,
        )
        # Zero bytes viewed as attention reads rows: the same zeros whatever the format.
        raw = torch.zeros((L, R * C + 1, layout.row_bytes), dtype=torch.uint8, device=self.device)
        self._kv = layout.row.attn_rows(raw).view(L, R * C + 1, layout.row.attn_width)
        self.full_kv = self._kv[:, : R * C].view(L, R, C, layout.row.attn_width)
        self._pool = torch.zeros(
            (L, R * ppr + 1, P, layout.index_bytes), dtype=torch.uint8, device=self.device
        )
        self._page_table = torch.arange(R * ppr, dtype=torch.int32, device=self.device).view(R, ppr)
        self.capturable = kernels.capturable

    @property
    def page_table(self) -> torch.Tensor:
        return self._page_table

    def index_pool_layer(self, layer: int) -> torch.Tensor:
        return self._pool[layer, :-1]

    def append(
        self,
        layer: int,
        kv_rows: torch.Tensor,
        index_rows: torch.Tensor,
        req_slots: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        lay = self.layout
        r, t = req_slots.long(), positions.long()
        ok = (
            (r >= 0) & (r < lay.max_requests) & (t >= 0) & (t < seq_lens.clamp(max=lay.max_context))
        )
        trash_kv = lay.max_requests * lay.max_context
        if lay.row.quantize is not None:
            stored = torch.empty(
                (kv_rows.shape[0], lay.row_bytes), dtype=torch.uint8, device=self.device
            )
            self.kernels.kv_quantize(kv_rows, stored, row_format=lay.row)
            kv_rows = lay.row.attn_rows(stored)
        self._kv[layer].index_copy_(0, torch.where(ok, r * lay.max_context + t, trash_kv), kv_rows)
        # Page r * ppr + t // P, slot t % P: request r's keys are contiguous. Pages hold their
        # keys' values, then their scales, so the store goes through the format's views.
        per_req = lay.max_pages_per_request * lay.page_size
        token = torch.where(ok, r * per_req + t, lay.max_requests * per_req)
        write_index_rows(
            self._pool[layer], token // lay.page_size, token % lay.page_size, index_rows, lay.index
        )

    def select(
        self, layer: int, topk: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor
    ) -> AttnRows:
        row_base = req_slots.long().clamp(min=0) * self.max_context
        return AttnRows(self._kv[layer], row_base, topk)

    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        row_base = torch.full(
            (topk.shape[0],), req_slot * self.max_context, dtype=torch.int64, device=self.device
        )
        return AttnRows(self._kv[layer], row_base, topk)
