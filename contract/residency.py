"""Residency of one request slot: which hot slots hold which of its positions (the window ring of
an offloaded request, its LRU slots and their order), kept in the shared tensors beside the rows.

Residency is only a cache of the host tier for offloaded requests: dropping it costs misses (the
rows are copied from the host again), never a different row. A restarted engine must drop it:
the engine it replaces may have been killed with a step launched past its last recorded token,
whose append overwrote a window-ring slot that the re-run of that step still reads, or between
a swap plan that mapped a position to a slot and the copy that was to fill the slot.
"""

from __future__ import annotations

import torch

from contract.layout import MODE_OFFLOADED
from contract.tensors import KVTensors


def forget(kv: KVTensors, slot: int) -> None:
    """No position of request slot `slot` is resident in an LRU slot; LRU order as at admission.
    Admission (kv_service.memory.store.reset_request) and a restarted engine both start here."""
    lay = kv.layout
    kv.token_slot[:, slot].fill_(-1)
    kv.slot_token[:, slot].fill_(-1)
    kv.hit_flag[slot].zero_()
    order = torch.arange(lay.window, lay.hot_slots, dtype=torch.int32, device=kv.lru_order.device)
    kv.lru_order[:, slot].copy_(order)


def reload_window(kv: KVTensors, slot: int, length: int) -> None:
    """An offloaded request's window ring as it stands once positions [0, length) are appended:
    positions [length - W, length) at slot t % W, copied from the host tier (the truth)."""
    lay = kv.layout
    low = max(0, length - lay.window)
    if int(kv.req_mode[slot]) != MODE_OFFLOADED or length <= low:
        return
    t = torch.arange(low, length)
    pages = kv.page_table[slot].to("cpu", torch.long)[t // lay.page_size]
    rows = kv.host_kv[pages, :, t % lay.page_size]  # [n, L, D]
    hot = kv.hot_kv[:, slot]  # [L, B, D] view
    ring = (t % lay.window).to(hot.device)
    hot.index_copy_(1, ring, rows.transpose(0, 1).to(hot.device))


def restart(kv: KVTensors, slot: int, length: int) -> None:
    """Request slot `slot` as a restarted engine may trust it, positions [0, length) committed:
    no LRU residency, the window ring re-read from the host tier. Synchronous: another process
    (the service's remote swap) may read these tensors next."""
    forget(kv, slot)
    reload_window(kv, slot, length)
    if kv.hot_kv.device.type == "cuda":
        torch.cuda.current_stream(kv.hot_kv.device).synchronize()
