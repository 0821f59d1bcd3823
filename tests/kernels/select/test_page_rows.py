"""kernels.select.page_rows (the baseline's pool rows of a selection, and its selected counters)
against ref_page_rows on irregular sizes: padding rows, positions < 0, unmapped pages, request
slots and positions past the table (clamped, never read outside), several column blocks a row."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_page_rows
from kernels.select.page_rows import page_rows


def _case(n: int, k: int, R: int, ppr: int, P: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(R * ppr, generator=g).to(torch.int32).view(R, ppr)
    table[torch.rand(R, ppr, generator=g) < 0.2] = -1  # unmapped pages
    topk = torch.randint(-3, ppr * P + 40, (n, k), generator=g, dtype=torch.int32)
    slots = torch.randint(-1, R + 2, (n,), generator=g, dtype=torch.int32)  # padding, past R
    return topk, slots, table


@pytest.mark.parametrize("n,k,R,ppr,P", [(1, 5, 1, 1, 4), (7, 33, 3, 5, 4), (4, 2100, 5, 9, 64)])
def test_page_rows_equal_the_reference(n: int, k: int, R: int, ppr: int, P: int) -> None:
    topk, slots, table = _case(n, k, R, ppr, P, seed=n + k)
    got, want = (torch.full((n, k), 7, dtype=torch.int32) for _ in range(2))
    counts = [torch.zeros(R + 1, 3, dtype=torch.int64) for _ in range(2)]
    page_rows(topk, slots, table, P, got, counts[0])
    ref_page_rows(topk, slots, table, P, want, counts[1])
    assert torch.equal(got, want)
    assert torch.equal(counts[0], counts[1])
    assert (got[topk < 0] == -1).all() and (got >= -1).all()
    assert int(counts[0][:, 0].sum()) == int((topk >= 0).sum())


def test_int64_slots_and_no_counters() -> None:
    """A prefill chunk's gather: one request slot for every row (int64), nothing counted."""
    topk, _, table = _case(6, 40, 4, 6, 8, seed=3)
    slots = torch.full((6,), 2, dtype=torch.int64)
    got, want = torch.empty(6, 40, dtype=torch.int32), torch.empty(6, 40, dtype=torch.int32)
    page_rows(topk, slots, table, 8, got)
    ref_page_rows(topk, slots, table, 8, want)
    assert torch.equal(got, want)


def test_bad_arguments_are_refused() -> None:
    topk, slots, table = _case(3, 8, 2, 4, 4, seed=4)
    out = torch.empty(3, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk"):
        page_rows(topk.long(), slots, table, 4, out)
    with pytest.raises(ValueError, match="req_slots"):
        page_rows(topk, slots[:2], table, 4, out)
    with pytest.raises(ValueError, match="page_table"):
        page_rows(topk, slots, table.long(), 4, out)
    with pytest.raises(ValueError, match="out"):
        page_rows(topk, slots, table, 4, out[:, :7])
    with pytest.raises(ValueError, match="counts"):
        page_rows(topk, slots, table, 4, out, torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.gpu
def test_page_rows_equal_the_reference_on_gpu() -> None:
    topk, slots, table = (t.cuda() for t in _case(61, 2048, 64, 513, 64, seed=5))
    got, want = (torch.empty(61, 2048, dtype=torch.int32, device="cuda") for _ in range(2))
    counts = [torch.zeros(65, 3, dtype=torch.int64, device="cuda") for _ in range(2)]
    page_rows(topk, slots, table, 64, got, counts[0])
    ref_page_rows(topk, slots, table, 64, want, counts[1])
    assert torch.equal(got, want) and torch.equal(counts[0], counts[1])
