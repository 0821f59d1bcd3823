"""The KV tensors the service owns, and the per-request resets done at admission.

`KVTensors` is the same set of tensors in every process: allocated here by the service (or by an
embedded engine), or mapped from the service's exports by an engine in another process.
Shapes are in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kv_service.layout import MODE_FREE, KVLayout

TENSOR_NAMES = ("host_kv", "hot_kv", "index_pool", "page_table", "req_mode",
                "token_slot", "slot_token", "lru_order", "hit_flag")


def tensor_specs(layout: KVLayout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor, by name."""
    lay = layout
    return {
        "host_kv": ((lay.num_pages, lay.num_layers, lay.page_size, lay.row_bytes), torch.uint8),
        "hot_kv": ((lay.num_layers, lay.max_requests, lay.hot_slots, lay.row_bytes), torch.uint8),
        "index_pool": ((lay.num_layers, lay.num_pages, lay.page_size, lay.index_bytes), torch.uint8),
        "page_table": ((lay.max_requests, lay.max_pages_per_request), torch.int32),
        "req_mode": ((lay.max_requests,), torch.int32),
        "token_slot": ((lay.num_layers, lay.max_requests, lay.max_context), torch.int32),
        "slot_token": ((lay.num_layers, lay.max_requests, lay.hot_slots), torch.int32),
        "lru_order": ((lay.num_layers, lay.max_requests, lay.lru_slots), torch.int32),
        "hit_flag": ((lay.max_requests, lay.hot_slots), torch.int8),
    }


@dataclass
class KVTensors:
    """Every KV tensor of one service. `host_rows` is `host_kv` as the kernels address it:
    the tensor itself on CPU, a UVA view of the pinned pages on GPU."""

    layout: KVLayout
    host_kv: torch.Tensor
    hot_kv: torch.Tensor
    index_pool: torch.Tensor
    page_table: torch.Tensor
    req_mode: torch.Tensor
    token_slot: torch.Tensor
    slot_token: torch.Tensor
    lru_order: torch.Tensor
    hit_flag: torch.Tensor
    host_rows: Any = None

    def __post_init__(self) -> None:
        for name, (shape, dtype) in tensor_specs(self.layout).items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous {shape} {dtype}, got "
                                 f"{tuple(t.shape)} {t.dtype}")
        if self.host_rows is None:
            self.host_rows = self.host_kv

    @property
    def device(self) -> torch.device:
        return self.hot_kv.device


def allocate_local(layout: KVLayout, device: torch.device | str = "cpu") -> KVTensors:
    """Plain in-process allocation (tests, embedded mode). Host tier pinned when on GPU."""
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
    kv.lru_order.copy_(torch.arange(lay.window, lay.hot_slots, dtype=torch.int32,
                                    device=kv.lru_order.device).expand_as(kv.lru_order))


def reset_request(kv: KVTensors, slot: int, mode: int, pages: list[int]) -> None:
    """Prepare request slot `slot` for a new request: its pages, its mode, empty residency."""
    lay = kv.layout
    if len(pages) > lay.max_pages_per_request:
        raise ValueError(f"{len(pages)} pages exceed {lay.max_pages_per_request} per request")
    row = torch.full((lay.max_pages_per_request,), -1, dtype=torch.int32)
    row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
    kv.page_table[slot].copy_(row)
    kv.token_slot[:, slot].fill_(-1)
    kv.slot_token[:, slot].fill_(-1)
    kv.lru_order[:, slot].copy_(torch.arange(lay.window, lay.hot_slots, dtype=torch.int32))
    kv.req_mode[slot] = mode


def free_request(kv: KVTensors, slot: int) -> None:
    kv.req_mode[slot] = MODE_FREE
    kv.page_table[slot].fill_(-1)
