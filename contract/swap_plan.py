"""One layer's swap-in on a KVTensors set, the one call shared by the engine's in-stream swap
(engine_client/kv/hisparse.py) and the service's remote swap (kv_service/memory/remote_swap.py):
both plan on the same residency tensors and copy between the same tiers. What goes in and what
comes out are named (PlanInputs, PlanOutputs) and unpacked once, here, into the plan kernel's
arguments. The kernels are passed in (Triton or their references), so contract imports no kernel
module."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from contract.tensors import KVTensors


class PlanInputs(NamedTuple):
    """One layer's batch: topk [bs, k] int32 (entries < 0 or >= their row's length are skipped),
    seq_lens [bs] int32, req_slots [bs] int32 (-1: padding row)."""

    topk: torch.Tensor
    seq_lens: torch.Tensor
    req_slots: torch.Tensor


class PlanOutputs(NamedTuple):
    """Where the plan writes, with G rows per request: slots [bs, k] int32 (each entry's hot
    slot or -1), miss_src / miss_dst [bs / G, G k] int64 (flat host row, flat hot row of each
    copy), miss_count [bs / G] int32; optionally miss_rows [bs / G] int32 (the misses summed
    over the rows, repeats counted). Counters the plan adds to, if given: counts [R + 1, 3]
    int64 per request slot (selected, misses, misses summed over rows; row R for padding rows)
    and totals [2] int64 (selected, misses)."""

    slots: torch.Tensor
    miss_src: torch.Tensor
    miss_dst: torch.Tensor
    miss_count: torch.Tensor
    miss_rows: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    totals: torch.Tensor | None = None


def swap_in(
    kv: KVTensors,
    layer: int,
    inputs: PlanInputs,
    outputs: PlanOutputs,
    *,
    plan: Callable[..., None],
    copy: Callable[..., None] | None,
    rows_per_request: int = 1,
) -> None:
    """Plan `layer`'s swap-in (hits, victims, the miss lists; residency and LRU updated in
    place), then, if `copy` is given, copy the misses host -> hot (a caller that overlaps the
    copy with compute passes None and copies the same lists itself)."""
    lay = kv.layout
    plan(
        layer,
        *inputs,
        *(kv.req_mode, kv.page_table, kv.token_slot, kv.slot_token, kv.lru_order, kv.hit_flag),
        *(outputs.slots, outputs.miss_src, outputs.miss_dst, outputs.miss_count),
        num_layers=lay.num_layers,
        page_size=lay.page_size,
        window=lay.window,
        rows_per_request=rows_per_request,
        out_miss_rows=outputs.miss_rows,
        out_counts=outputs.counts,
        out_totals=outputs.totals,
        **_options(kv),
    )
    if copy is not None:
        copy(kv.host_rows, kv.hot_kv, outputs.miss_src, outputs.miss_dst, outputs.miss_count)


def _options(kv: KVTensors) -> dict:
    """Only a set with a shared hot region passes it, only a layout with host reads asks for
    host rows (misses past the victims, read by attention): other plans keep their signature."""
    extra: dict = {} if kv.shared is None else {"shared": kv.shared}
    if kv.layout.host_reads:
        extra["host_fallback"] = True
    return extra
