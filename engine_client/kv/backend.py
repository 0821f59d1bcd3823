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

from contract.layout import INDEX_FORMATS, ROW_FORMATS, KVLayout
from engine_client.kv.index_keys import encode_index_keys
from engine_client.kv.kernel_set import KernelSet
from kernels.reference import write_index_rows

ROW_DIM = 576


@dataclass(frozen=True)
class AttnRows:
    """What attention reads: rows kv ([rows, 576] bf16, or fp8 rows [rows, 656] uint8),
    row_base [n] int64, slots [n, k] int32."""

    kv: torch.Tensor
    row_base: torch.Tensor
    slots: torch.Tensor


class KVBackend(ABC):
    """Where the KV rows and indexer keys of every request slot live."""

    num_layers: int
    max_requests: int
    max_context: int
    topk: int
    index_format: str
    row_format: str = "bf16"
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
        """Store rows kv_rows [n, 576] bf16 (quantized here when row_format is fp8) and
        index_rows [n, I] uint8 at (req_slot, position).
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
            q, w, self.index_pool_layer(layer), self.page_table, req_slots, seq_lens, out
        )

    def stats(self) -> dict[str, int]:
        """Counters since the last reset (reads the device: call between steps)."""
        return {}

    def fill_synthetic(
        self, req_slot: int, n_tokens: int, *, seed: int = 0, chunk: int = 4096, start: int = 0
    ) -> None:
        """Write random KV rows and index keys for positions [start, n_tokens) of `req_slot`, so
        a benchmark starts from a long context without a prefill. Deterministic in (seed, layer,
        chunk start) on a given device type, so every backend stores the same bytes."""
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
                rows = torch.randn((m, ROW_DIM), generator=gen, device=self.device)
                keys = torch.randn((m, 128), generator=gen, device=self.device)
                pos = torch.arange(first, first + m, dtype=torch.int32, device=self.device)
                self.append(
                    layer,
                    rows.to(torch.bfloat16),
                    encode_index_keys(keys, self.index_format),
                    r[:m],
                    pos,
                    lens[:m],
                )


@dataclass(frozen=True)
class BaselineConfig:
    """Sizes of the all-on-GPU cache: L layers x R request slots x C tokens."""

    num_layers: int
    max_requests: int
    max_context: int
    topk: int
    page_size: int = 64
    index_format: str = "bf16"
    row_format: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_requests", "max_context", "topk", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.index_format not in INDEX_FORMATS:
            raise ValueError(f"index_format must be one of {sorted(INDEX_FORMATS)}")
        if self.row_format not in ROW_FORMATS:
            raise ValueError(f"row_format must be one of {sorted(ROW_FORMATS)}")

    @classmethod
    def from_layout(cls, layout: KVLayout, max_requests: int | None = None) -> "BaselineConfig":
        return cls(
            layout.num_layers,
            max_requests or layout.max_requests,
            layout.max_context,
            layout.topk,
            layout.page_size,
            layout.index_format,
            layout.row_format,
        )

    @property
    def pages_per_request(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def cache_bytes(self) -> int:
        kv = self.num_layers * self.max_requests * self.max_context * ROW_FORMATS[self.row_format]
        index = (
            self.num_layers
            * self.max_requests
            * self.pages_per_request
            * self.page_size
            * INDEX_FORMATS[self.index_format]
        )
        return kv + index


class BaselineBackend(KVBackend):
    """All KV on the device, in pages of P tokens: KV rows [L, N * P, 576] bf16 (fp8 rows:
    [L, N * P, 656] uint8, quantized by the same kernel as the HiSparse appends) and an
    index-key pool [L, N, P, I], both addressed through one page table (N = R * ppr pages, as
    many as R requests of max_context tokens need). The page table is the identity (request
    r owns pages [r * ppr, (r + 1) * ppr)) unless the engine's control maps pages itself: with
    prefix caching, requests share the pages of a cached prefix (engine_client.kv.local_control).
    One extra row per layer of each (the last) absorbs the writes of padding rows and unmapped
    pages, so appends need no data-dependent branch and stay graph-safe."""

    def __init__(
        self,
        cfg: BaselineConfig,
        *,
        kernels: KernelSet,
        device: torch.device | str = "cpu",
        page_table: torch.Tensor | None = None,
    ) -> None:
        self.cfg = cfg
        self.kernels = kernels
        self.device = torch.device(device)
        self.num_layers, self.max_requests = cfg.num_layers, cfg.max_requests
        self.max_context, self.topk, self.index_format = cfg.max_context, cfg.topk, cfg.index_format
        self.row_format = cfg.row_format
        L, R, C, P, ppr = (
            cfg.num_layers,
            cfg.max_requests,
            cfg.max_context,
            cfg.page_size,
            cfg.pages_per_request,
        )
        ib = INDEX_FORMATS[cfg.index_format]
        width, dtype = (
            (ROW_DIM, torch.bfloat16)
            if cfg.row_format == "bf16"
            else (ROW_FORMATS[cfg.row_format], torch.uint8)
        )
        N = R * ppr
        self._kv = torch.zeros((L, N * P + 1, width), dtype=dtype, device=self.device)
        # Request r's rows by position, while the page table is the identity (tests).
        self.full_kv = self._kv[:, : N * P].view(L, R, ppr * P, width)[:, :, :C]
        self._pool = torch.zeros((L, N + 1, P, ib), dtype=torch.uint8, device=self.device)
        identity = torch.arange(N, dtype=torch.int32, device=self.device).view(R, ppr)
        if page_table is not None and (
            page_table.shape != identity.shape or page_table.dtype != torch.int32
        ):
            raise ValueError(f"page_table must be int32 {tuple(identity.shape)}")
        self._page_table = identity if page_table is None else page_table
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
        cfg, P = self.cfg, self.cfg.page_size
        r, t = req_slots.long(), positions.long()
        ok = (
            (r >= 0) & (r < cfg.max_requests) & (t >= 0) & (t < seq_lens.clamp(max=cfg.max_context))
        )
        page = self._pages_of(r, t)
        ok &= page >= 0
        trash = self._pool.shape[1] - 1  # the extra page, and the extra row after N * P
        page = torch.where(ok, page, trash)
        if cfg.row_format == "fp8":
            fp8 = torch.empty(
                (kv_rows.shape[0], self._kv.shape[-1]), dtype=torch.uint8, device=self.device
            )
            self.kernels.kv_quantize(kv_rows, fp8)
            kv_rows = fp8
        self._kv[layer].index_copy_(0, torch.where(ok, page * P + t % P, trash * P), kv_rows)
        # fp8 pages are page-blocked (values, then scales): the store goes through the
        # layout's views.
        write_index_rows(self._pool[layer], page, t % P, index_rows)

    def _pages_of(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Page ids (int64, -1 unmapped) of positions [n] or [n, k] of req_slots [n], clamped
        into the page table: a bad index reads a wrong entry, never outside."""
        ppr = self.cfg.pages_per_request
        rows = self._page_table[req_slots.clamp(0, self.max_requests - 1)]
        col = (positions.clamp(min=0) // self.cfg.page_size).clamp(max=ppr - 1)
        if positions.dim() == 1:
            return rows.gather(1, col[:, None])[:, 0].long()
        return rows.gather(1, col).long()

    def _attn_rows(self, layer: int, topk: torch.Tensor, req_slots: torch.Tensor) -> AttnRows:
        """Rows of top-k positions: their page's rows, in top-k order (-1 stays -1)."""
        page = self._pages_of(req_slots.long(), topk.long())
        rows = page * self.cfg.page_size + topk.long().clamp(min=0) % self.cfg.page_size
        slots = torch.where((topk >= 0) & (page >= 0), rows, -1).to(torch.int32)
        base = torch.zeros(topk.shape[0], dtype=torch.int64, device=self.device)
        return AttnRows(self._kv[layer], base, slots)

    def select(
        self, layer: int, topk: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor
    ) -> AttnRows:
        return self._attn_rows(layer, topk, req_slots)

    def gather(self, layer: int, topk: torch.Tensor, req_slot: int, seq_len: int) -> AttnRows:
        slots = torch.full((topk.shape[0],), req_slot, dtype=torch.int64, device=self.device)
        return self._attn_rows(layer, topk, slots)
