"""The all-on-GPU baseline's rows of a top-k selection: each selected position's row in the paged
KV pool, through the page table, in one launch (the baseline's counterpart of the swap plan).

slot[b, i] = page_table[r, t // P] * P + t % P for t = topk[b, i] and r = req_slots[b], -1 where
t < 0 or the page is unmapped (< 0). Bad input never reads outside the table: r is clamped into
[0, R) and the page column into [0, ppr), as the PyTorch expression it replaces did
(kernels.reference.select.ref_page_rows). With `counts` [R + 1, 3] int64 it also adds each row's
selected positions (t >= 0) to column 0 of its request slot's counter (row R for padding rows and
slots past the table), integer atomics, so the sums never depend on the order.

Why: the PyTorch expression took ~18 small launches a layer over [n, k] int64 tensors, plus ~4
for the counters, in every baseline decode step: glue a real engine fuses into its attention's
block table, charged here to the baseline's step (the comparison's other side).
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _page_rows_kernel(
    topk_ptr,
    slots_ptr,
    table_ptr,
    out_ptr,
    counts_ptr,
    K,
    R,
    PPR,
    s_topk,
    s_out,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    COUNT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < K
    t = tl.load(topk_ptr + b * s_topk + i, mask=ok, other=-1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    r = tl.minimum(tl.maximum(slot, 0), R - 1)
    tc = tl.maximum(t, 0)
    col = tl.minimum(tc // P, PPR - 1)
    page = tl.load(table_ptr + r * PPR + col, mask=ok, other=-1).to(tl.int64)
    row = tl.where((t >= 0) & (page >= 0), page * P + tc % P, -1)
    tl.store(out_ptr + b * s_out + i, row.to(tl.int32), mask=ok)
    if COUNT:
        chosen = tl.sum((ok & (t >= 0)).to(tl.int64), axis=0)
        counter = tl.where((slot >= 0) & (slot < R), slot, R)
        tl.atomic_add(counts_ptr + counter * 3, chosen)


def page_rows(
    topk: torch.Tensor,
    req_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """out [n, k] int32 <- the pool rows of topk [n, k] (int32) for request slots req_slots [n]
    through page_table [R, ppr] int32 (see the module doc); counts [R + 1, 3] int64, if given,
    gains each row's selected positions in column 0."""
    n, k = topk.shape
    R, ppr = page_table.shape
    _check(topk, req_slots, page_table, page_size, out, counts)
    if n == 0 or k == 0:
        return
    _page_rows_kernel[(n, triton.cdiv(k, _BLOCK))](
        topk, req_slots, page_table, out, out if counts is None else counts,
        k, R, ppr, topk.stride(0), out.stride(0),
        P=page_size, BLOCK=_BLOCK, COUNT=counts is not None,
    )  # fmt: skip


def _check(topk, req_slots, page_table, page_size, out, counts) -> None:
    n, k = topk.shape
    dev = topk.device
    if topk.dtype != torch.int32 or topk.stride(1) != 1:
        raise ValueError(f"page_rows: topk must be int32 [n, k], unit last stride: {topk.dtype}")
    if req_slots.shape != (n,) or req_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_rows: req_slots must be int32/int64 [{n}]: {req_slots.shape}")
    if page_table.dim() != 2 or page_table.dtype != torch.int32 or not page_table.is_contiguous():
        raise ValueError("page_rows: page_table must be a contiguous int32 [R, ppr]")
    if page_size <= 0 or page_table.numel() == 0:
        raise ValueError(f"page_rows: page_size {page_size} and the table must be non-empty")
    if out.shape != (n, k) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"page_rows: out must be int32 [{n}, {k}], unit last stride")
    rows = page_table.shape[0] + 1
    if counts is not None and (
        counts.shape != (rows, 3) or counts.dtype != torch.int64 or not counts.is_contiguous()
    ):
        raise ValueError(f"page_rows: counts must be a contiguous int64 [{rows}, 3]")
    tensors = (req_slots, page_table, out) + (() if counts is None else (counts,))
    if any(t.device != dev for t in tensors):
        raise ValueError("page_rows: every tensor must be on topk's device")
