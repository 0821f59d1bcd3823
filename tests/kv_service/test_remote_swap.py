"""Remote swap's guard against top-k rows that repeat a position (kv_service.memory.remote_swap)."""

from __future__ import annotations

import torch

from kv_service.memory.remote_swap import mask_repeated_rows


def test_repeated_positions_refused_only_in_rows_that_are_planned() -> None:
    topk = torch.tensor(
        [[2, 2, 9, 9], [3, -1, -1, 7], [5, 5, 5, 5], [1, 2, 3, 1]], dtype=torch.int32
    )
    slots = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
    out = torch.full_like(slots, 99)
    # Row 0 and 3 repeat a position; row 1 repeats only padding; row 2 is a padding row.
    assert int(mask_repeated_rows(topk, slots, out)) == 2
    assert out.tolist() == [-1, 1, -1, -1]
