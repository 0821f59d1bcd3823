"""The remote-swap exchange, as both sides see it: the tensors ("xchg_*") the service exports
for one layer's swap-in launched on the engine's behalf, and the names of the two interprocess
events that order the engine's stream with the service's (`kv_service.remote_swap` explains
the protocol).
"""

from __future__ import annotations

import torch

from contract.layout import KVLayout

EVENT_NAMES = ("xchg_ready", "xchg_done")


def exchange_specs(layout: KVLayout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every exchange tensor, by name; rows are batch rows."""
    r, k = layout.max_requests, layout.topk
    return {
        "xchg_topk": ((r, k), torch.int32),
        "xchg_seq_lens": ((r,), torch.int32),
        "xchg_req_slots": ((r,), torch.int32),
        "xchg_slots": ((r, k), torch.int32),
        "xchg_miss_src": ((r, k), torch.int64),
        "xchg_miss_dst": ((r, k), torch.int64),
        "xchg_miss_count": ((r,), torch.int32),
    }
