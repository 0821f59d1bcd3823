"""bench/kernels/host_read_cases.py's inputs (CPU): the host entries name the host copy of the row
they replace, as the plan's host fallback would (-2 - row), and the copy path's miss lists hold
exactly the same rows, each request's first; the attention over them is checked on the GPU by
the case itself (bits equal), and in tests/kernels/attention/test_attention_host_rows.py."""

from __future__ import annotations

import torch

from bench.kernels.host_read_cases import host_entries, miss_lists


def test_host_entries_and_miss_lists_name_the_same_rows() -> None:
    g = torch.Generator().manual_seed(0)
    slots = torch.stack([torch.randperm(50, generator=g)[:7] for _ in range(3)]).to(torch.int32)
    row_base = torch.tensor([0, 50, 100])
    mask = torch.rand(slots.shape, generator=g) < 0.5
    mask[2] = False  # a request with no miss
    enc = host_entries(slots, row_base, mask)
    assert enc.dtype == torch.int32
    assert torch.equal(enc[~mask], slots[~mask])
    rows = (row_base[:, None] + slots.long())[mask]
    assert torch.equal((-2 - enc[mask].long()), rows)
    src, dst, count = miss_lists(slots, row_base, mask)
    assert torch.equal(src, dst) and count.tolist() == mask.sum(1).tolist()
    for b in range(3):
        listed = sorted(src[b, : count[b]].tolist())
        assert listed == sorted((row_base[b] + slots[b].long())[mask[b]].tolist())
