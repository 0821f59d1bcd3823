"""Allocation of the KV tensors (`contract.tensors.KVTensors`) and the per-request resets done
at admission: the service's (or an embedded engine's) side of the shared tensor set.
"""

from __future__ import annotations

import torch

from contract.layout import MODE_FREE, KVLayout
from contract.tensors import KVTensors, tensor_specs


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
    kv.lru_order.copy_(
        torch.arange(
            lay.window, lay.hot_slots, dtype=torch.int32, device=kv.lru_order.device
        ).expand_as(kv.lru_order)
    )


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
