"""The all-on-GPU baseline: every request's whole KV on the device, no service. The comparison
point of every benchmark, and the reference the HiSparse modes must equal bit for bit."""

from __future__ import annotations

import torch

from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.kv.backend import AttnRows, SharedBackend
from kernels.kit.kernel_set import KernelSet
from kernels.reference import write_index_rows


def baseline_layout(
    num_layers: int,
    max_requests: int,
    max_context: int,
    topk: int,
    page_size: int = 64,
    row_format: str = "bf16",
    index_format: str = "bf16",
) -> KVLayout:
    """The layout of an all-on-GPU cache: the index pool holds every request's whole context
    (num_pages = R * pages per request); there are no hot buffers, so hot_slots and window are
    only the smallest the layout accepts."""
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
        row_format=row_format,
        index_format=index_format,
    )


class BaselineBackend(SharedBackend):
    """All KV on the device, in pages of P tokens: rows [L, N * P] as attention reads them
    (stored bytes encoded by the same kernels as the HiSparse appends) and an index-key pool
    [L, N, P, I], both addressed through one page table (N = R * ppr pages, as many as R
    requests of max_context tokens need). The page table is the identity (request r owns pages
    [r * ppr, (r + 1) * ppr)) unless the engine's control maps pages itself: with prefix
    caching, requests share the pages of a cached prefix (engine_client.client.local_control).
    One extra row per layer of each (the last) absorbs the writes of padding rows and unmapped
    pages, so appends need no data-dependent branch and stay graph-safe. Of the layout it uses
    the sizes and formats, not the hot buffers (`baseline_layout` makes one)."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        kernels: KernelSet,
        device: torch.device | str = "cpu",
        page_table: torch.Tensor | None = None,
    ) -> None:
        super().__init__(layout, kernels, torch.device(device), layout.max_requests)
        L, R, C, P, ppr = (
            layout.num_layers,
            layout.max_requests,
            layout.max_context,
            layout.page_size,
            layout.max_pages_per_request,
        )
        N, width = R * ppr, layout.row.attn_width
        # Zero bytes viewed as attention reads rows: the same zeros whatever the format.
        raw = torch.zeros((L, N * P + 1, layout.row_bytes), dtype=torch.uint8, device=self.device)
        self._kv = layout.row.attn_rows(raw).view(L, N * P + 1, width)
        # Request r's rows by position, while the page table is the identity (tests).
        self.full_kv = self._kv[:, : N * P].view(L, R, ppr * P, width)[:, :, :C]
        self._pool = torch.zeros(
            (L, N + 1, P, layout.index_bytes), dtype=torch.uint8, device=self.device
        )
        # The stored bytes, what a prefill engine exports: rows [L, N * P + 1, D], keys the pool.
        self.stored_rows, self.stored_index = raw, self._pool
        identity = torch.arange(N, dtype=torch.int32, device=self.device).view(R, ppr)
        if page_table is not None and (
            page_table.shape != identity.shape or page_table.dtype != torch.int32
        ):
            raise ValueError(f"page_table must be int32 {tuple(identity.shape)}")
        self._page_table = identity if page_table is None else page_table

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
        lay, P = self.layout, self.layout.page_size
        r, t = req_slots.long(), positions.long()
        ok = (
            (r >= 0) & (r < lay.max_requests) & (t >= 0) & (t < seq_lens.clamp(max=lay.max_context))
        )
        page = self._pages_of(r, t)
        ok &= page >= 0
        trash = self._pool.shape[1] - 1  # the extra page, and the extra row after N * P
        page = torch.where(ok, page, trash)
        if lay.row.quantize is not None:
            stored = torch.empty(
                (kv_rows.shape[0], lay.row_bytes), dtype=torch.uint8, device=self.device
            )
            self.kernels.kv_quantize(kv_rows, stored, row_format=lay.row)
            kv_rows = lay.row.attn_rows(stored)
        self._kv[layer].index_copy_(0, torch.where(ok, page * P + t % P, trash * P), kv_rows)
        # Pages hold their keys' values, then their scales, so the store goes through the
        # format's views.
        write_index_rows(self._pool[layer], page, t % P, index_rows, lay.index)

    def _pages_of(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Page ids (int64, -1 unmapped) of positions [n] of req_slots [n], clamped into the
        page table: a bad index reads a wrong entry, never outside."""
        ppr = self.layout.max_pages_per_request
        rows = self._page_table[req_slots.clamp(0, self.max_requests - 1)]
        col = (positions.clamp(min=0) // self.layout.page_size).clamp(max=ppr - 1)
        return rows.gather(1, col[:, None])[:, 0].long()

    def _attn_rows(
        self, layer: int, topk: torch.Tensor, req_slots: torch.Tensor, counted: bool = False
    ) -> AttnRows:
        """Rows of top-k positions: their page's rows, in top-k order (-1 stays -1), in one
        launch (kernels/select/page_rows.py); counted: the selected positions also go to the
        request slots' counters."""
        slots = torch.empty(topk.shape, dtype=torch.int32, device=self.device)
        counts = self._slot_counts.table if counted else None
        P = self.layout.page_size
        self.kernels.page_rows(topk, req_slots, self._page_table, P, slots, counts)
        base = torch.zeros(topk.shape[0], dtype=torch.int64, device=self.device)
        return AttnRows(self._kv[layer], base, slots)

    def select(
        self,
        layer: int,
        topk: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        row0: int = 0,
        rows_per_request: int = 1,
    ) -> AttnRows:
        """Every row is on the device: nothing to copy, no misses."""
        return self._attn_rows(layer, topk, req_slots, counted=True)

    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        slots = torch.full((topk.shape[0],), req_slot, dtype=torch.int64, device=self.device)
        return self._attn_rows(layer, topk, slots)

    def rebind(self, kv: KVTensors | None, xchg: dict[str, torch.Tensor] | None = None) -> None:
        raise TypeError("the baseline owns its memory: there is no service mapping to rebind")
