"""The KV backend interface the model and the engine loop call, and what every backend shares.

A backend stores new KV rows and indexer keys (`append`), scores the indexer keys
(`index_scores`), and hands attention the rows of a top-k selection as (kv rows, row_base, slots)
(`select` for decode, `gather` for prefill). Attention reads row `row_base[b] + slots[b, i]` of
`kv`, in slot-list order, so every backend that yields the same rows gives bitwise-identical
output. It also counts, per request slot, the positions each decode step selected, the ones it
copied from the host, and the copies it would have made without merging the rows of one
request (`counts`). The backends: `kv/baseline.py` (all KV on the device),
`kv/hisparse.py` (the service's memory: in-stream and remote swap).

Tensor conventions: req_slots, positions, seq_lens [n] int32; a row with req_slot -1 is padding
and changes nothing; seq_lens count the stored tokens including the new one.
A speculative verify step hands `select` D + 1 consecutive rows per request
(`rows_per_request`): they share one swap-in over the union of their top-k.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from contract.layout import KVLayout
from contract.tensors import KVTensors
from kernels.formats import INDEX_DIM, ROW_VALUES
from kernels.kit.kernel_set import KernelSet


@dataclass(frozen=True)
class AttnRows:
    """What attention reads: rows kv (as the layout's row format has attention read them:
    `RowFormat.attn_rows`), row_base [n] int64, slots [n, k] int32; with the layout's
    host_reads, `host` is the host tier's rows (same view) that slots <= -2 name (-2 - row)."""

    kv: torch.Tensor
    row_base: torch.Tensor
    slots: torch.Tensor
    host: Any = None


@runtime_checkable
class KVBackend(Protocol):
    """Where the KV rows and indexer keys of every request slot live: everything the model
    (engine_client.model), the decode runner and the engine loop use of a backend."""

    layout: KVLayout
    num_layers: int
    max_requests: int
    max_context: int
    topk: int
    device: torch.device
    kernels: KernelSet
    # The decode path (append, index_scores, select) may be captured in a CUDA graph.
    capturable: bool
    # Most decode rows one step may hand `select`.
    max_batch: int
    # Parts a decode layer's batch is cut into (HiSparseBackend overlaps their miss copies).
    microbatches: int
    # The stream the decode step must launch on (None: the caller's; SharedBackend's doc).
    compute_stream: torch.cuda.Stream | None

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

    def index_pool_layer(self, layer: int) -> torch.Tensor:
        """Index keys of `layer` as [pages, P, I] uint8, addressed through `page_table`."""

    @property
    def page_table(self) -> torch.Tensor:
        """[R, pages per request] int32 page ids of the index pool."""

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

    def select(
        self,
        layer: int,
        topk: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        row0: int = 0,
        rows_per_request: int = 1,
    ) -> AttnRows:
        """Decode: make the top-k rows of each batch row readable, and count them. Graph-safe
        when capturable. row0: first row of this micro-batch part in the whole batch.
        rows_per_request G: rows [g G, (g + 1) G) are one request's and share one swap-in
        (kernels.swap.plan); seq_lens is then each row's own, the longest decides the window."""

    def attention_ready(self, row0: int) -> None:
        """Before attention reads the rows of the part starting at row0 (microbatches > 1)."""

    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        """Prefill of one request: the top-k rows of each chunk token (all < seq_len, the
        request's stored length), read from the authoritative store without touching
        residency/LRU state. May synchronize."""

    @property
    def counts(self) -> torch.Tensor:
        """(selected, misses, misses summed over rows) [R, 3] int64 per request slot, added by
        every decode `select` on the device (a captured graph keeps counting); the caller
        zeroes it. The last column is what planning each row alone would copy: it equals the
        misses unless several rows of a request shared a swap-in."""

    def rebind(self, kv: KVTensors | None, xchg: dict[str, torch.Tensor] | None = None) -> None:
        """Use another mapping of the same layout (a restarted service's memory), or none."""

    def fill_synthetic(
        self,
        req_slot: int,
        n_tokens: int,
        *,
        seed: int = 0,
        chunk: int = 4096,
        start: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Random KV rows and index keys for positions [start, n_tokens) of `req_slot`."""


class SlotCounts:
    """Per request slot (selected, misses, misses summed over rows) counters on the device.
    Row R collects padding rows (request slot -1), so adding needs no data-dependent branch.
    HiSparse's plan kernel adds to `table` itself; `add` is for the backends without a plan."""

    def __init__(self, max_requests: int, device: torch.device) -> None:
        self._counts = torch.zeros((max_requests + 1, 3), dtype=torch.int64, device=device)

    def _index(self, req_slots: torch.Tensor) -> torch.Tensor:
        return torch.where(req_slots >= 0, req_slots, self._counts.shape[0] - 1).long()

    def add(
        self,
        req_slots: torch.Tensor,
        topk: torch.Tensor,
        misses: torch.Tensor | None,
        row_misses: torch.Tensor | None = None,
        rows_per_request: int = 1,
    ) -> None:
        """topk [n, k] of rows req_slots [n]; misses and row_misses [n / rows_per_request], one
        per request (row_misses None: the misses themselves)."""
        self._counts[:, 0].index_add_(0, self._index(req_slots), (topk >= 0).sum(dim=1))
        if misses is None:
            return
        idx = self._index(req_slots[::rows_per_request])
        self._counts[:, 1].index_add_(0, idx, misses.long().clamp(min=0))
        rows = misses if row_misses is None else row_misses
        self._counts[:, 2].index_add_(0, idx, rows.long().clamp(min=0))

    @property
    def counts(self) -> torch.Tensor:
        return self._counts[:-1]

    @property
    def table(self) -> torch.Tensor:
        """[R + 1, 3] int64, the padding row last."""
        return self._counts


class SharedBackend:
    """What every backend does the same way: sizes from its layout, the indexer over its index
    pool, the slot counters and the synthetic fill. Subclasses provide append, select, gather,
    index_pool_layer and page_table (the KVBackend protocol)."""

    capturable: bool = True
    microbatches: int = 1
    # The stream the model's kernels must run on (None: the caller's): set by a backend whose
    # side stream holds SMs of its own (kernels/sm_partition.py), to the rest of the SMs.
    compute_stream: torch.cuda.Stream | None = None

    def __init__(
        self, layout: KVLayout, kernels: KernelSet, device: torch.device, max_batch: int
    ) -> None:
        self.layout, self.kernels, self.device = layout, kernels, device
        self.num_layers, self.max_requests = layout.num_layers, layout.max_requests
        self.max_context, self.topk = layout.max_context, layout.topk
        self.capturable = kernels.capturable
        self.max_batch = max_batch
        self._slot_counts = SlotCounts(layout.max_requests, device)

    @property
    def counts(self) -> torch.Tensor:
        return self._slot_counts.counts

    def index_scores(
        self: KVBackend,
        layer: int,
        q: torch.Tensor,
        w: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
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

    def attention_ready(self, row0: int) -> None:
        """Nothing to wait for unless a backend copies on a side stream."""

    def stats(self) -> dict[str, int]:
        """Counters since the last reset (reads the device: call between steps)."""
        return {}

    def fill_synthetic(
        self: KVBackend,
        req_slot: int,
        n_tokens: int,
        *,
        seed: int = 0,
        chunk: int = 4096,
        start: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Write random KV rows and index keys for positions [start, n_tokens) of `req_slot`, so
        a benchmark starts from a long context without a prefill. Deterministic in (seed, layer,
        chunk start) on a given device type, so every backend stores the same bytes.
        `progress(1)` is called after each of the num_layers * ceil((n_tokens - start) / chunk)
        chunks."""
        if (
            not 0 <= req_slot < self.max_requests
            or not 0 <= start < n_tokens <= self.max_context
            or chunk <= 0
        ):
            raise ValueError(
                f"bad synthetic fill: slot {req_slot}, {n_tokens} tokens, chunk {chunk}"
            )
        r = torch.full((chunk,), req_slot, dtype=torch.int32, device=self.device)
        lens = torch.full((chunk,), n_tokens, dtype=torch.int32, device=self.device)
        for layer in range(self.num_layers):
            for first in range(start, n_tokens, chunk):
                m = min(chunk, n_tokens - first)
                gen = torch.Generator(device=self.device)
                gen.manual_seed(zlib.crc32(f"{seed}:{layer}:{first}".encode()))
                rows = torch.randn((m, ROW_VALUES), generator=gen, device=self.device)
                keys = torch.randn((m, INDEX_DIM), generator=gen, device=self.device)
                pos = torch.arange(first, first + m, dtype=torch.int32, device=self.device)
                self.append(
                    layer,
                    rows.to(torch.bfloat16),
                    self.layout.index.encode(keys),
                    r[:m],
                    pos,
                    lens[:m],
                )
                if progress is not None:
                    progress(1)
