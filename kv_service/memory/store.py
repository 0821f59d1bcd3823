"""The service's memory: what it shares (the KV tensors, `contract.tensors.KVTensors`, and the
remote-swap exchange tensors) and their initial state, the per-request resets done at admission,
and the row copies of prefix sharing. The service's (or an embedded engine's) side of the shared
tensor set; where the memory lives (files, CUDA IPC) is `kv_service.memory.segment`'s business.

Prefix sharing moves rows between a request's hot buffer and the host tier only while no other
request can read the destination: a cached prefix is copied into the new request's own hot
slots at admission, and a resident request's full page is copied to its host page before the
page is published. Nothing here writes a published page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contract import residency
from contract.exchange import exchange_specs
from contract.layout import MODE_FREE, MODE_OFFLOADED, MODE_RESIDENT, KVLayout, request_slots
from contract.segment_map import as_kv_tensors
from contract.shared_region import SharedRegion, region_specs
from contract.tensors import KVTensors, tensor_specs

# A tensor to share: shape, dtype, and whether it lives in a host file (else device memory).
Spec = tuple[tuple[int, ...], torch.dtype, bool]


@dataclass
class ServiceMemory:
    """Every tensor a service shares, initialized: the KV tensors and the exchange tensors."""

    kv: KVTensors
    exchange: dict[str, torch.Tensor]


def service_specs(layout: KVLayout, device: torch.device) -> dict[str, Spec]:
    """Every tensor a service shares, by name. The host tier is always a host file (pinned
    and registered on GPU); in CPU mode every tensor is a file, for the engine to map."""
    on_cpu = device.type == "cpu"
    specs = {n: (s, d, on_cpu or n == "host_kv") for n, (s, d) in tensor_specs(layout).items()}
    region = region_specs(layout, layout.shared_slots) if layout.shared_slots else {}
    specs |= {n: (s, d, on_cpu) for n, (s, d) in region.items()}
    return specs | {n: (s, d, on_cpu) for n, (s, d) in exchange_specs(layout).items()}


def initialize(
    layout: KVLayout, tensors: dict[str, torch.Tensor], device: torch.device
) -> ServiceMemory:
    """The shared tensors (zeroed) in their initial state: every request slot free, the shared
    region (if any) empty, and every exchange row padding (request slot -1), so a stray remote
    swap touches nothing."""
    kv_names = set(tensor_specs(layout))
    kv = as_kv_tensors(layout, {n: t for n, t in tensors.items() if n in kv_names}, device)
    region_names = set(region_specs(layout, layout.shared_slots)) if layout.shared_slots else set()
    if region_names:
        region = {n: tensors[n] for n in region_names}
        kv.shared = SharedRegion.of(layout, layout.shared_slots, region, device)
    clear_all(kv)
    exchange = {n: t for n, t in tensors.items() if n not in kv_names | region_names}
    exchange["xchg_req_slots"].fill_(-1)
    exchange["xchg_topk"].fill_(-1)
    return ServiceMemory(kv, exchange)


def allocate_local(layout: KVLayout, device: torch.device | str = "cpu") -> KVTensors:
    """Plain in-process allocation (tests, embedded mode). Host tier pinned when on GPU. With
    layout.shared_slots, the shared hot region of cached prefix rows (contract.shared_region)."""
    device = torch.device(device)
    tensors = {}
    for name, (shape, dtype) in tensor_specs(layout).items():
        if name == "host_kv":
            tensors[name] = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        else:
            tensors[name] = torch.zeros(shape, dtype=dtype, device=device)
    kv = KVTensors(layout=layout, **tensors)
    if device.type == "cuda":
        from kernels.uva import UVATensor

        kv.host_rows = UVATensor(kv.host_kv)
    if layout.shared_slots:
        kv.shared = SharedRegion.allocate(layout, layout.shared_slots, device)
    clear_all(kv)
    return kv


def clear_all(kv: KVTensors) -> None:
    """Every request slot free, residency empty, scratch zero."""
    kv.req_mode.fill_(MODE_FREE)
    kv.page_table.fill_(-1)
    kv.token_slot.fill_(-1)
    kv.slot_token.fill_(-1)
    kv.hit_flag.zero_()
    lay = kv.layout
    kv.lru_order.copy_(
        torch.arange(
            lay.window, lay.hot_slots, dtype=torch.int32, device=kv.lru_order.device
        ).expand_as(kv.lru_order)
    )
    if kv.shared is not None:
        kv.shared.clear()


def reset_request(kv: KVTensors, slot: int, mode: int, pages: list[int]) -> None:
    """Prepare request slot `slot` for a new request: its pages, its mode, empty residency."""
    lay = kv.layout
    if len(pages) > lay.max_pages_per_request:
        raise ValueError(f"{len(pages)} pages exceed {lay.max_pages_per_request} per request")
    row = torch.full((lay.max_pages_per_request,), -1, dtype=torch.int32)
    row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
    kv.page_table[slot].copy_(row)
    residency.forget(kv, slot)
    kv.req_mode[slot] = mode
    if kv.shared is not None:
        kv.shared.shared_len[slot] = 0


def free_request(kv: KVTensors, slot: int) -> None:
    kv.req_mode[slot] = MODE_FREE
    kv.page_table[slot].fill_(-1)
    if kv.shared is not None:
        kv.shared.shared_len[slot] = 0


class TensorRows:
    """The ledger's RowStore on a KVTensors set (kv_service.books.ledger)."""

    def __init__(self, kv: KVTensors) -> None:
        self.kv, self.layout = kv, kv.layout
        # The shared region lives in the last request slots' buffers: never handed out.
        self.request_slots = request_slots(kv.layout)

    def reset(self, slot: int, mode: int, pages: list[int]) -> None:
        reset_request(self.kv, slot, mode, pages)

    def load_prefix(self, slot: int, mode: int, pages: list[int], stored: int, cached: int) -> None:
        load_cached_prefix(self.kv, slot, mode, stored)  # the page table holds `pages`
        if self.kv.shared is not None and mode == MODE_OFFLOADED:
            # Rows below `cached` are in shared read-only pages (appends start there): shared
            # hot rows. Rows a prefill engine landed past them are in the request's own pages.
            self.kv.shared.shared_len[slot] = cached

    def forget_pages(self, pages: list[int]) -> None:
        """Pages back in the free pool: their shared hot rows must never hit again."""
        if self.kv.shared is not None:
            self.kv.shared.forget_pages(pages)

    def store_pages(self, slot: int, mode: int, pages: list[int], indices: list[int]) -> None:
        if mode == MODE_RESIDENT:  # offloaded requests wrote their host rows on append
            store_resident_pages(self.kv, slot, pages, indices)

    def free(self, slot: int) -> None:
        free_request(self.kv, slot)

    def sync(self) -> None:
        # Another process reads these tensors as soon as it gets our reply.
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()


def load_cached_prefix(kv: KVTensors, slot: int, mode: int, cached: int) -> None:
    """Copy the rows of a cached prefix [0, cached) from the host tier into the hot slots where a
    request that computed them itself would hold them: a resident request keeps token t at hot
    slot t; an offloaded one keeps its newest W tokens in the window ring (slot t % W), so the
    cached tokens [cached - W, cached) go there (later tokens overwrite them as they come).

    On GPU the miss-copy kernel reads the rows straight from the pinned host tier (UVA), as a
    decode step's misses are: a gather on the host would land them in pageable memory first and
    copy that with the driver's staging, synchronously (issue 40, item 5). The row numbers are
    computed on the device from the slot's page table, which `reset_request` just wrote."""
    lay = kv.layout
    low = 0 if mode == MODE_RESIDENT else max(0, cached - lay.window)
    if cached <= low:
        return
    src, dst = prefix_rows(kv, slot, mode, low, cached)
    hot = kv.hot_kv.view(-1, lay.row_bytes)
    if kv.device.type != "cuda":
        hot.index_copy_(0, dst.flatten(), kv.host_kv.view(-1, lay.row_bytes)[src.flatten()])
        return
    from kernels.swap.miss_copy import miss_copy  # Triton: only a GPU service compiles it

    count = torch.full((lay.num_layers,), cached - low, dtype=torch.int32, device=kv.device)
    miss_copy(kv.host_rows, kv.hot_kv, src, dst, count)


def prefix_rows(
    kv: KVTensors, slot: int, mode: int, low: int, cached: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat host rows and flat hot rows [L, cached - low] (int64, on the tensors' device) of
    tokens [low, cached) of request slot `slot`, per layer (docs/ARCHITECTURE.md, Memory)."""
    lay, dev = kv.layout, kv.device
    L, P = lay.num_layers, lay.page_size
    t = torch.arange(low, cached, device=dev)
    page = kv.page_table[slot].to(torch.int64)[t // P]
    layer = torch.arange(L, device=dev)[:, None]
    src = (page[None] * L + layer) * P + t % P
    hot_slot = t if mode == MODE_RESIDENT else t % lay.window
    dst = (layer * lay.max_requests + slot) * lay.hot_slots + hot_slot
    return src.contiguous(), dst.contiguous()


def store_resident_pages(kv: KVTensors, slot: int, pages: list[int], indices: list[int]) -> None:
    """Copy full pages `indices` of a resident request from its hot slots (token t at slot t)
    into their host pages, which resident requests otherwise never write: a page must hold its
    rows in the host tier before other requests may read it there."""
    P = kv.layout.page_size
    for i in indices:
        # Asynchronous into pinned memory; ServiceCore syncs before any admission answers.
        kv.host_kv[pages[i]].copy_(kv.hot_kv[:, slot, i * P : (i + 1) * P], non_blocking=True)
