"""The remote-swap exchange, as both sides see it: the tensors ("xchg_*") the service exports
for one layer's swap-in launched on the engine's behalf, and the names of the two interprocess
events that order the engine's stream with the service's (`kv_service.memory.remote_swap` explains
the protocol).
"""

from __future__ import annotations

import torch

from contract.layout import MAX_DRAFT_TOKENS, KVLayout
from contract.swap_plan import PlanInputs, PlanOutputs

EVENT_NAMES = ("xchg_ready", "xchg_done")


def exchange_specs(layout: KVLayout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every exchange tensor, by name; rows are batch rows, room for every
    request slot with a speculative verify step's most rows (MAX_DRAFT_TOKENS + 1). With G rows
    per request, the first n rows of xchg_miss_src / _dst are read as [n / G, G k] (one miss
    list per request), and xchg_miss_count / xchg_miss_rows hold one count per request."""
    r, k = layout.max_requests * (MAX_DRAFT_TOKENS + 1), layout.topk
    return {
        "xchg_topk": ((r, k), torch.int32),
        "xchg_seq_lens": ((r,), torch.int32),
        "xchg_req_slots": ((r,), torch.int32),
        "xchg_slots": ((r, k), torch.int32),
        "xchg_miss_src": ((r, k), torch.int64),
        "xchg_miss_dst": ((r, k), torch.int64),
        "xchg_miss_count": ((r,), torch.int32),
        "xchg_miss_rows": ((r,), torch.int32),
    }


def exchange_inputs(xchg: dict[str, torch.Tensor], n: int) -> PlanInputs:
    """The plan's inputs: batch rows [0, n) of the exchange."""
    return PlanInputs(xchg["xchg_topk"][:n], xchg["xchg_seq_lens"][:n], xchg["xchg_req_slots"][:n])


def exchange_outputs(xchg: dict[str, torch.Tensor], n: int, rows_per_request: int) -> PlanOutputs:
    """The plan's outputs for batch rows [0, n) of G = rows_per_request rows per request:
    slots [n, k], miss src / dst [n / G, G k], miss count and miss rows [n / G]."""
    k, groups = xchg["xchg_slots"].shape[1], n // rows_per_request
    return PlanOutputs(
        xchg["xchg_slots"][:n],
        xchg["xchg_miss_src"][:n].view(groups, rows_per_request * k),
        xchg["xchg_miss_dst"][:n].view(groups, rows_per_request * k),
        xchg["xchg_miss_count"][:groups],
        xchg["xchg_miss_rows"][:groups],
    )
