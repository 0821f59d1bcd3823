"""The set of KV tensors every process shares: names, shapes and dtypes implied by a layout, and
`KVTensors`, the same tensors whether the service allocated them, an embedded engine allocated
them locally, or an engine in another process mapped the service's exports
(`contract.segment_map`). Allocation and the per-request resets are the service's
(`kv_service.memory.store`). Shapes are in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from contract.layout import KVLayout

TENSOR_NAMES = (
    "host_kv",
    "hot_kv",
    "index_pool",
    "page_table",
    "req_mode",
    "token_slot",
    "slot_token",
    "lru_order",
    "hit_flag",
)


def tensor_specs(layout: KVLayout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor, by name."""
    lay = layout
    return {
        "host_kv": ((lay.num_pages, lay.num_layers, lay.page_size, lay.row_bytes), torch.uint8),
        "hot_kv": ((lay.num_layers, lay.max_requests, lay.hot_slots, lay.row_bytes), torch.uint8),
        "index_pool": (
            (lay.num_layers, lay.num_pages, lay.page_size, lay.index_bytes),
            torch.uint8,
        ),
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
    # The shared hot region (contract.shared_region.SharedRegion) or None: prefix sharing's
    # hot rows. Its tensors are exported apart from these (to the session that plans with it).
    shared: Any = None

    def __post_init__(self) -> None:
        for name, (shape, dtype) in tensor_specs(self.layout).items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(
                    f"{name}: expected contiguous {shape} {dtype}, got {tuple(t.shape)} {t.dtype}"
                )
        if self.host_rows is None:
            self.host_rows = self.host_kv

    @property
    def device(self) -> torch.device:
        return self.hot_kv.device
