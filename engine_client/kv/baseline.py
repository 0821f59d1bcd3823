"""The all-on-GPU baseline: every request's whole KV on the device, no service. The comparison
point of every benchmark, and the reference the HiSparse modes must equal bit for bit."""

from __future__ import annotations

import torch

from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.kv.backend import AttnRows, SharedBackend
from engine_client.kv.kernel_set import KernelSet
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
    """All KV on the device: a full cache [L, R, C] of rows as attention reads them (stored
    bytes encoded by the same kernels as the HiSparse appends) and an index-key pool with a
    fixed page table (request r owns pages [r * ppr, (r + 1) * ppr)). One extra row per layer
    of each (the last) absorbs the writes of padding rows, so appends need no data-dependent
    branch and stay graph-safe. Of the layout it uses the sizes and formats, not the hot
    buffers (`baseline_layout` makes one)."""

    def __init__(
        self, layout: KVLayout, *, kernels: KernelSet, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(layout, kernels, torch.device(device), layout.max_requests)
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
        self,
        layer: int,
        topk: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        row0: int = 0,
        rows_per_request: int = 1,
    ) -> AttnRows:
        """Every row is on the device: nothing to copy, no misses."""
        self._slot_counts.add(req_slots, topk, None)
        row_base = req_slots.long().clamp(min=0) * self.max_context
        return AttnRows(self._kv[layer], row_base, topk)

    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        row_base = torch.full(
            (topk.shape[0],), req_slot * self.max_context, dtype=torch.int64, device=self.device
        )
        return AttnRows(self._kv[layer], row_base, topk)

    def rebind(self, kv: KVTensors | None, xchg: dict[str, torch.Tensor] | None = None) -> None:
        raise TypeError("the baseline owns its memory: there is no service mapping to rebind")
