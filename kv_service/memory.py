"""The service's memory: what it shares (the KV tensors, `contract.tensors.KVTensors`, and the
remote-swap exchange tensors) and their initial state, and the per-request resets done at
admission. The service's (or an embedded engine's) side of the shared tensor set; where the
memory lives (files, CUDA IPC) is `kv_service.segment`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contract.exchange import exchange_specs
from contract.layout import MODE_FREE, KVLayout
from contract.segment_map import as_kv_tensors
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
    return specs | {n: (s, d, on_cpu) for n, (s, d) in exchange_specs(layout).items()}


def initialize(
    layout: KVLayout, tensors: dict[str, torch.Tensor], device: torch.device
) -> ServiceMemory:
    """The shared tensors (zeroed) in their initial state: every request slot free, and every
    exchange row padding (request slot -1), so a stray remote swap touches nothing."""
    kv_names = set(tensor_specs(layout))
    kv = as_kv_tensors(layout, {n: t for n, t in tensors.items() if n in kv_names}, device)
    clear_all(kv)
    exchange = {n: t for n, t in tensors.items() if n not in kv_names}
    exchange["xchg_req_slots"].fill_(-1)
    exchange["xchg_topk"].fill_(-1)
    return ServiceMemory(kv, exchange)


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
