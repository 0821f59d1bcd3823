"""Remote swap's service side (kv_service.memory.remote_swap.RemoteSwapper) on rows from any
engine: a row that repeats positions is planned, each missed position copied once, every copy
of it reading the slot that holds its row."""

from __future__ import annotations

import torch
from lru_simulator import check_bijection

from contract.layout import MODE_OFFLOADED, KVLayout
from engine_client.kv.remote_swap import allocate_exchange
from kv_service.memory.remote_swap import RemoteSwapper
from kv_service.memory.store import allocate_local, reset_request

LAYOUT = KVLayout(
    num_layers=2,
    max_requests=2,
    hot_slots=12,
    window=2,
    topk=8,
    page_size=4,
    num_pages=16,
    max_context=30,
)


def test_repeated_positions_are_planned_once() -> None:
    kv = allocate_local(LAYOUT)
    reset_request(kv, 1, MODE_OFFLOADED, [7, 3, 5, 0, 1, 2, 4, 6])
    kv.host_kv.copy_(torch.randint(0, 256, kv.host_kv.shape, dtype=torch.uint8))
    x = allocate_exchange(LAYOUT)
    swapper = RemoteSwapper(kv, x)
    swapper.claim("s")
    # 12 and 20 twice (misses), 29 twice (window), padding twice.
    row = [12, 20, 12, 20, 29, 29, -1, -1]
    x["xchg_topk"][0] = torch.tensor(row, dtype=torch.int32)
    x["xchg_seq_lens"][0], x["xchg_req_slots"][0] = 30, 1
    first = swapper.run("s", 1, 1, {1})
    assert (first.misses, first.hits, first.bytes_moved) == (2, 4, 2 * LAYOUT.row_bytes)
    slots = x["xchg_slots"][0].tolist()
    assert slots[0] == slots[2] and slots[1] == slots[3] and slots[4] == slots[5] == 29 % 2
    for t, s in zip(row[:4], slots[:4]):
        page = [7, 3, 5, 0, 1, 2, 4, 6][t // 4]
        assert torch.equal(kv.hot_kv[1, 1, s], kv.host_kv[page, 1, t % 4])
    check_bijection(
        kv.slot_token[1, 1].tolist(), kv.token_slot[1, 1].tolist(), kv.lru_order[1, 1].tolist(), 2
    )
    again = swapper.run("s", 1, 1, {1})  # now every position is resident: all hits
    assert (again.misses, again.hits) == (0, 6) and x["xchg_slots"][0].tolist() == slots
