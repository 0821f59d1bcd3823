"""KV backends on the service's memory (`KVTensors`, allocated locally or mapped from the service).

HiSparseBackend ("embedded" / "service" modes) launches the swap-in in the engine's own stream:
per layer, swap_plan finds hits and victims, miss_copy moves the missed rows host -> hot buffer,
and attention reads the layer's hot buffer through the plan's slot list.

RemoteSwapBackend ("service-remote-swap", kv/remote_swap.py) runs the same plan + copy
elsewhere (the service, over a unary RPC).
"""

from __future__ import annotations

from typing import Any

import torch

from contract.layout import MAX_DRAFT_TOKENS, MODE_OFFLOADED, MODE_RESIDENT
from contract.swap_plan import PlanInputs, PlanOutputs, swap_in
from contract.tensors import KVTensors
from engine_client.kv.backend import AttnRows, SharedBackend
from engine_client.kv.side_copy import SideCopy
from kernels.kit.kernel_set import KernelSet
from kernels.swap.copy_grid import CopyGrid
from kernels.uva import UVATensor

# The side-stream miss copy's grid when micro-batches overlap it with compute: every working
# CTA slows the memory-bound kernels on its SM (issue 38: the fp8 step 14.07 ms at 24 CTAs,
# 16.21 at 64), so the step's miss bytes pick how many of the 64 launched CTAs work, one per
# bytes_per_program (kernels/swap/copy_grid.py; bench/profile/copy_sweep.py measures the rule).
OVERLAP_COPY_GRID = CopyGrid(programs=64, bytes_per_program=1 << 20, min_programs=16)


class HiSparseBackend(SharedBackend):
    """In-stream swap on service memory. Decode buffers are sized for `max_batch` rows.

    microbatches > 1: the model splits each decode layer's batch into that many parts (see
    SparseAttention.attend); on CUDA each part's miss copy then runs on a side stream, on the grid
    `copy_grid` (default OVERLAP_COPY_GRID), while the main stream scores and plans
    the next part and attends the previous one. Results are bitwise the same: every kernel is
    row-independent and each part owns its rows of the plan's output buffers."""

    def __init__(
        self,
        kv: KVTensors,
        *,
        kernels: KernelSet,
        max_batch: int | None = None,
        microbatches: int = 1,
        copy_grid: CopyGrid = OVERLAP_COPY_GRID,
        rows_per_request: int = 1,
    ) -> None:
        lay = kv.layout
        n, k = max_batch or lay.max_requests, lay.topk
        if not 0 < n <= lay.max_requests:
            raise ValueError(f"max_batch must be in [1, {lay.max_requests}], got {n}")
        if not 1 <= rows_per_request <= MAX_DRAFT_TOKENS + 1:
            raise ValueError(
                f"rows_per_request must be in [1, {MAX_DRAFT_TOKENS + 1}], got {rows_per_request}"
            )
        super().__init__(lay, kernels, kv.device, n)
        self.kv = kv
        # Plan outputs for up to n requests of rows_per_request rows each, flat: a call with G
        # rows per request views its part's rows as [rows, k] and its miss lists as [rows/G, G k].
        rows = n * rows_per_request
        self.rows_per_request = rows_per_request
        self._init_plan_outputs(rows, k)
        if microbatches < 1:
            raise ValueError(f"microbatches must be positive, got {microbatches}")
        self.microbatches, self.copy_grid = microbatches, copy_grid
        # The side stream serves the Triton kernels (the references take no grid size).
        overlap = microbatches > 1 and self.device.type == "cuda" and kernels.capturable
        self._side = (
            SideCopy(copy_grid, self.device, kernels, lay.row_bytes, rows, k) if overlap else None
        )
        self.compute_stream = None if self._side is None else self._side.compute_stream
        self._hot_rows = self._hot_views(kv)
        self._host_rows = self._host_view(kv)

    def set_copy_grid(self, grid: CopyGrid) -> None:
        """Later copies on `grid` (a sweep's; recapture after), on a new side stream if needed."""
        self.copy_grid = grid
        if self._side is not None:
            self._side.set_grid(grid)
            self.compute_stream = self._side.compute_stream

    def _init_plan_outputs(self, rows: int, k: int) -> None:
        """The swap plan's outputs, allocated once (a captured graph keeps their addresses)."""
        self.out_slots = torch.full((rows, k), -1, dtype=torch.int32, device=self.device)
        self.miss_src = torch.zeros((rows * k,), dtype=torch.int64, device=self.device)
        self.miss_dst = torch.zeros((rows * k,), dtype=torch.int64, device=self.device)
        self.miss_count = torch.zeros((rows,), dtype=torch.int32, device=self.device)
        self.miss_rows = torch.zeros((rows,), dtype=torch.int32, device=self.device)
        # (selected, misses) for `stats`, int64 on the device: the plan kernel adds to them (and
        # to the per-slot counts) without a sync. Padding rows of a graph's warm-up and capture
        # select nothing (their top-k is -1), so they leave both unchanged.
        self.counters = torch.zeros(2, dtype=torch.int64, device=self.device)

    def _hot_views(self, kv: KVTensors) -> list[torch.Tensor]:
        # Per-layer row views of the hot buffers, made once so a captured graph keeps them.
        return [self._rows(kv.hot_kv[l]) for l in range(self.layout.num_layers)]

    def _host_view(self, kv: KVTensors | None) -> Any:
        """The host tier's rows as attention reads them, when the plan may name them
        (host_reads: misses without a victim); a UVA view on GPU. None otherwise."""
        if kv is None or not self.layout.host_reads:
            return None
        host = kv.host_rows
        return host.map(self._rows) if isinstance(host, UVATensor) else self._rows(host)

    def _rows(self, raw: torch.Tensor) -> torch.Tensor:
        """Rows as attention reads them (the row format's view of the stored bytes)."""
        return self.layout.row.attn_rows(raw)

    def rebind(self, kv: KVTensors | None, xchg: dict[str, torch.Tensor] | None = None) -> None:
        """Use another mapping of the same layout (a restarted service's memory), or none:
        with kv None every reference to the lost service's memory is dropped, so that it can be
        unmapped, and a stray launch fails here instead of reading it. Graphs captured on the
        old memory must be dropped by the caller."""
        if kv is not None and (kv.layout != self.layout or kv.device != self.device):
            raise ValueError(
                f"cannot rebind to {kv.layout} on {kv.device}: the backend was "
                f"built for {self.layout} on {self.device}"
            )
        self.kv = kv  # type: ignore[assignment]
        self._hot_rows = [] if kv is None else self._hot_views(kv)
        self._host_rows = self._host_view(kv)

    @property
    def page_table(self) -> torch.Tensor:
        return self.kv.page_table

    def index_pool_layer(self, layer: int) -> torch.Tensor:
        return self.kv.index_pool[layer]

    def append(
        self,
        layer: int,
        kv_rows: torch.Tensor,
        index_rows: torch.Tensor,
        req_slots: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        kv = self.kv
        # bf16 rows: kv_append encodes them as the layout's row format says.
        self.kernels.kv_append(
            layer,
            kv_rows,
            index_rows,
            req_slots,
            positions,
            seq_lens,
            kv.req_mode,
            kv.page_table,
            kv.host_rows,
            kv.hot_kv,
            kv.index_pool,
            window=self.layout.window,
            row_format=self.layout.row,
            index_format=self.layout.index,
        )

    def _hot(self, layer: int, req_slots: torch.Tensor, slots: torch.Tensor) -> AttnRows:
        row_base = req_slots.long().clamp(min=0) * self.layout.hot_slots
        return AttnRows(self._hot_rows[layer], row_base, slots, self._host_rows)

    def _outputs(self, row0: int, n: int, G: int) -> PlanOutputs:
        """This part's plan outputs: slots [n, k], miss src/dst [n / G, G k], counts [n / G]
        (rows row0.. of the flat buffers; parts never overlap), and the counters the plan adds
        to (`counts` per request slot, `stats` totals)."""
        k, groups = self.topk, n // G
        flat = slice(row0 * k, (row0 + n) * k)
        return PlanOutputs(
            self.out_slots[row0 : row0 + n],
            self.miss_src[flat].view(groups, G * k),
            self.miss_dst[flat].view(groups, G * k),
            self.miss_count[row0 : row0 + groups],
            self.miss_rows[row0 : row0 + groups],
            self._slot_counts.table,
            self.counters,
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
        """row0: first row of this part of the batch in the plan's output buffers."""
        G = rows_per_request
        if G > self.rows_per_request:
            raise ValueError(f"{G} rows per request, the backend holds {self.rows_per_request}")
        out = self._outputs(row0, topk.shape[0], G)
        if self.kv.shared is not None and layer == 0 and row0 == 0:
            # A new step: the shared slots read so far may be evicted again (on the device,
            # so a captured graph counts its replays).
            self.kv.shared.next_step()
        swap_in(
            self.kv,
            layer,
            PlanInputs(topk, seq_lens, req_slots),
            out,
            plan=self.kernels.swap_plan,
            copy=self.kernels.miss_copy if self._side is None else None,
            rows_per_request=G,
        )
        if self._side is not None:
            lists = (out.miss_src, out.miss_dst, out.miss_count)
            self._side.copy(row0, self.kv.host_rows, self.kv.hot_kv, *lists)
        return self._hot(layer, req_slots, out.slots)

    def attention_ready(self, row0: int) -> None:
        """Before attention reads the rows of the part starting at row0: wait for its copy."""
        if self._side is not None:
            self._side.ready(row0)

    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        """Resident: token t is hot slot t. Offloaded: read the rows from the host tier (the only
        complete copy; the window ring and LRU slots are left alone) into a scratch buffer,
        whichever way moves fewer rows: the whole context [0, seq_len) once, addressed by
        position, or each chunk token's own top-k list. Both yield the same rows in the same
        slot-list order, so the choice never changes the output."""
        mode = int(self.kv.req_mode[req_slot])
        n, k = topk.shape
        if mode == MODE_RESIDENT:
            if seq_len > self.layout.hot_slots:
                raise ValueError(
                    f"resident request slot {req_slot} cannot hold {seq_len} tokens "
                    f"in {self.layout.hot_slots} hot slots"
                )
            return self._hot(
                layer, torch.full((n,), req_slot, dtype=torch.int32, device=self.device), topk
            )
        if mode != MODE_OFFLOADED:
            raise ValueError(f"request slot {req_slot} is not admitted (mode {mode})")
        if seq_len <= n * k:
            positions = torch.arange(seq_len, dtype=torch.int32, device=self.device)[None]
            rows = self._read_host(layer, req_slot, positions)
            return AttnRows(rows, torch.zeros(n, dtype=torch.int64, device=self.device), topk)
        rows = self._read_host(layer, req_slot, topk)
        j = torch.arange(k, dtype=torch.int32, device=self.device)
        slots = torch.where(topk >= 0, j, -1).to(torch.int32)
        return AttnRows(rows, torch.arange(n, device=self.device, dtype=torch.int64) * k, slots)

    def _read_host(self, layer: int, req_slot: int, positions: torch.Tensor) -> torch.Tensor:
        """Host rows of `positions` [m, w] (ascending, -1 padding at the end of each row) into
        a fresh row buffer (attention's format), row i * w + j holding positions[i, j]."""
        lay, dev = self.layout, self.device
        m, w = positions.shape
        t = positions.long().clamp(min=0)
        pages = self.kv.page_table[req_slot].long()[t // lay.page_size]
        src = ((pages * lay.num_layers + layer) * lay.page_size + t % lay.page_size).contiguous()
        dst = (torch.arange(m, device=dev)[:, None] * w + torch.arange(w, device=dev)).contiguous()
        # Valid entries are a prefix of each row, so a count per row selects them.
        count = (positions >= 0).sum(dim=1, dtype=torch.int32)
        scratch = torch.zeros((m * w, lay.row_bytes), dtype=torch.uint8, device=dev)
        self.kernels.miss_copy(self.kv.host_rows, scratch, src, dst, count)
        return self._rows(scratch)

    def stats(self) -> dict[str, int]:
        selected, misses = self.counters.tolist()
        return {
            "selected": selected,
            "hits": selected - misses,
            "misses": misses,
            "miss_bytes": misses * self.layout.row_bytes,
        }

    def reset_stats(self) -> None:
        self.counters.zero_()
