"""The one call of the swap-plan kernel on a KVTensors set, shared by the engine's in-stream
swap (engine_client/kv/hisparse.py) and the service's remote swap
(kv_service/memory/remote_swap.py): both run the same plan on the same residency tensors, so
the 19 arguments are spelled once. The kernel is passed in (a Triton kernel or its reference),
so contract imports no kernel module."""

from __future__ import annotations

from collections.abc import Callable

import torch

from contract.tensors import KVTensors


def plan_swap(
    kernel: Callable[..., None],
    kv: KVTensors,
    layer: int,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    rows_per_request: int = 1,
    miss_rows: torch.Tensor | None = None,
) -> None:
    """Hits, victims and the miss lists of one layer, residency and LRU updated in place.
    batch: (topk, seq_lens, req_slots); outputs: (slots, miss_src, miss_dst, miss_count)."""
    lay = kv.layout
    kernel(
        layer,
        *batch,
        kv.req_mode,
        kv.page_table,
        kv.token_slot,
        kv.slot_token,
        kv.lru_order,
        kv.hit_flag,
        *outputs,
        num_layers=lay.num_layers,
        page_size=lay.page_size,
        window=lay.window,
        rows_per_request=rows_per_request,
        out_miss_rows=miss_rows,
    )
