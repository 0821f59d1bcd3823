"""Swap-in plan: per (layer, request) find the hits of a top-k selection and give each miss an
LRU victim slot (with host_fallback, the misses past the victims read their host rows).
Semantics and tensor layout: docs/ARCHITECTURE.md ("Plan semantics").

One program per request: a group of `rows_per_request` consecutive batch rows (1 for plain
decode; D + 1 for a speculative verify step, whose rows share one plan over the union of their
top-k). A resident request maps position t to slot t; an offloaded one does O(B + G k) work in
three phases separated by barriers (kernels/swap/lru.py):
1. look up each position (window ring, `token_slot`), mark LRU hits in `hit_flag`; keep only
   the first occurrence of each missed position (repeats read its slot);
2. stable-partition `lru_order` into (kept, hits, victims) with prefix sums and scatter it back;
3. read each miss's victim from the tail of the new order, update residency, emit the miss list.
With a shared hot region (issue 40), launches around this one serve the cached prefix's rows
first (kernels/swap/shared_phase.py); without one, that branch is compiled out (SHARED).
"""

from __future__ import annotations

from typing import Any

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels import formats
from kernels.swap.counts import add_counts, add_totals
from kernels.swap.entries import group_entries
from kernels.swap.lru import plan_offloaded
from kernels.swap.plan_checks import check_sizes, check_tensors
from kernels.swap.shared_phase import after_plan, before_plan, check_region, plan_args

MODE_RESIDENT = tl.constexpr(formats.MODE_RESIDENT)
MODE_OFFLOADED = tl.constexpr(formats.MODE_OFFLOADED)
# One program per request; at B = 4096 more warps shorten the O(B) scans. Tune on the H200.
NUM_WARPS_LARGE = 8


@triton.jit(do_not_specialize=["layer"])
def _swap_plan_kernel(
    topk_ptr,
    seq_lens_ptr,
    req_slots_ptr,
    req_mode_ptr,
    page_table_ptr,
    token_slot_ptr,
    slot_token_ptr,
    lru_order_ptr,
    hit_flag_ptr,
    out_slots_ptr,
    out_src_ptr,
    out_dst_ptr,
    out_count_ptr,
    out_rows_ptr,
    counts_ptr,
    totals_ptr,
    key_ptr,
    groups_ptr,
    meta_ptr,
    victims_ptr,
    claim_key_ptr,
    claim_owner_ptr,
    claim_rank_ptr,
    claims_ptr,
    base,
    S,
    layer,
    k,
    R,
    C,
    B,
    max_pages,
    L: tl.constexpr,
    P: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_OUT: tl.constexpr,
    COUNTS: tl.constexpr,
    TOTALS: tl.constexpr,
    SHARED: tl.constexpr,
    HOST_FALLBACK: tl.constexpr,
):
    b = tl.program_id(0)
    r, r_ok, mode, i, in_k, t, row_len = group_entries(
        b, topk_ptr, seq_lens_ptr, req_slots_ptr, req_mode_ptr, k, R, C, G, BLOCK_K
    )
    # The request's length: its longest row's (the window ring holds every row's token).
    seq_len = tl.max(row_len, 0)
    if mode == MODE_OFFLOADED:
        m, row_misses = plan_offloaded(
            layer,
            b,
            G * k,
            i,
            t,
            in_k,
            row_len,
            seq_len,
            r,
            page_table_ptr,
            token_slot_ptr,
            slot_token_ptr,
            lru_order_ptr,
            hit_flag_ptr,
            out_slots_ptr,
            out_src_ptr,
            out_dst_ptr,
            out_count_ptr,
            out_rows_ptr,
            R,
            C,
            B,
            max_pages,
            L,
            P,
            W,
            BLOCK_K,
            BLOCK_N,
            ROWS_OUT,
            key_ptr,
            groups_ptr,
            meta_ptr,
            victims_ptr,
            claim_key_ptr,
            claim_owner_ptr,
            claim_rank_ptr,
            claims_ptr,
            base,
            S,
            SHARED,
            HOST_FALLBACK,
        )
    else:
        # Resident: token t is hot slot t. Free slots and padding rows select nothing.
        ok = (mode == MODE_RESIDENT) & (t >= 0) & (t < tl.minimum(row_len, B))
        tl.store(out_slots_ptr + b.to(tl.int64) * G * k + i, tl.where(ok, t, -1), mask=in_k)
        tl.store(out_count_ptr + b, 0)
        if ROWS_OUT:
            tl.store(out_rows_ptr + b, 0)
        m = tl.full((), 0, tl.int32)
        row_misses = tl.full((), 0, tl.int32)
    sel = in_k & (t >= 0)
    if TOTALS:
        add_totals(totals_ptr, sel, m)
    if COUNTS:
        add_counts(counts_ptr, req_slots_ptr, b, sel, i, k, m, row_misses, R, G)


def swap_plan(
    layer: int,
    topk: torch.Tensor,
    seq_lens: torch.Tensor,
    req_slots: torch.Tensor,
    req_mode: torch.Tensor,
    page_table: torch.Tensor,
    token_slot: torch.Tensor,
    slot_token: torch.Tensor,
    lru_order: torch.Tensor,
    hit_flag: torch.Tensor,
    out_slots: torch.Tensor,
    out_miss_src: torch.Tensor,
    out_miss_dst: torch.Tensor,
    out_miss_count: torch.Tensor,
    *,
    num_layers: int,
    page_size: int,
    window: int,
    rows_per_request: int = 1,
    out_miss_rows: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
    out_totals: torch.Tensor | None = None,
    num_warps: int | None = None,
    shared: Any = None,
    host_fallback: bool = False,
) -> None:
    """Plan one layer's swap-in for a batch; updates residency state in place.

    topk [bs, k] int32 (entries < 0 or >= their row's seq_len are skipped), seq_lens [bs] int32,
    req_slots [bs] int32 (-1: padding row; a request slot names one group of a launch at most:
    programs run at once on a GPU, and two of one request would race on its residency),
    req_mode [R] int32, page_table [R, max_pages] int32,
    token_slot [L, R, C] int32, slot_token [L, R, B] int32, lru_order [L, R, B - W] int32,
    hit_flag [R, B] int8 (zero before and after).
    rows_per_request G: rows [g G, (g + 1) G) are one request's (a verify step's D + 1 rows;
    the group's request slot is its first row's) and share one plan over the union of their
    positions, and the window is the longest row's. Repeated positions (in one row or across
    the rows of a request) are harmless: each missed position gets one victim and is copied
    once, its repeats read the same slot.
    Outputs: out_slots [bs, k] int32 (each row's own list through the shared slots),
    out_miss_src / out_miss_dst [bs / G, G k] int64 (flat host row, flat hot row; entries at
    j >= out_miss_count[g] are left untouched), out_miss_count [bs / G] int32, and, if given,
    out_miss_rows [bs / G] int32: the missed entries, repeats counted (what G separate plans
    of the same state would copy, when each row holds distinct positions).
    Counters added to, if given (the select bookkeeping, folded in here because the plan knows
    each entry's fate): out_counts [R + 1, 3] int64, per request slot (selected: entries >= 0
    of each row, at the row's own slot; misses; misses summed over rows), row R for padding
    rows (req_slot outside [0, R)); out_totals [2] int64, (selected, misses) of the batch.
    Launch-only (no sync, no allocation), so it can be captured in a CUDA graph.
    shared: the shared hot region of cached prefix rows (contract.shared_region, issue 40):
    offloaded requests' cached-prefix rows go through it first, in launches before and after
    this kernel (kernels/swap/shared_phase.py); None compiles that branch out.
    host_fallback: G k may exceed B - W; a missed position left without a victim is read from
    the host tier: its entries (repeats too) get -2 - (its flat host row) in out_slots, no copy
    is queued and it does not become resident; the counters count it as a miss (out_counts
    column 1, out_totals[1]: missed positions, copied or read from the host). Precondition:
    host rows fit int32, num_pages * L * P < 2^31 - 2 (the layout's check). False compiles the
    path out.
    """
    (bs, k), (L, R, C), B = topk.shape, token_slot.shape, slot_token.shape[2]
    W, G = window, rows_per_request
    shapes = dict(bs=bs, k=k, L=L, R=R, C=C, B=B, W=W, P=page_size, max_pages=page_table.shape[1])
    check_sizes(layer, num_layers, shapes, G, host_fallback)
    state = (req_mode, page_table, token_slot, slot_token, lru_order, hit_flag)
    outs = (out_slots, out_miss_src, out_miss_dst, out_miss_count)
    optional = dict(out_miss_rows=out_miss_rows, out_counts=out_counts, out_totals=out_totals)
    check_tensors((topk, seq_lens, req_slots, *state, *outs), optional, G, W)
    n = bs // G
    if shared is not None:
        check_region(shared, L, R, B, n, bs * k)
    if bs == 0:
        return
    block_n = max(16, triton.next_power_of_2(B - W))
    block_k = max(16, triton.next_power_of_2(G * k))
    if shared is not None:
        dims = dict(k=k, R=R, C=C, max_pages=page_table.shape[1], n=n, G=G, P=page_size, W=W)
        args = (topk, seq_lens, req_slots, req_mode, page_table, token_slot, out_slots)
        before_plan(layer, args, shared, dims | {"BLOCK_K": block_k})
    _swap_plan_kernel[(n,)](
        topk,
        seq_lens,
        req_slots,
        req_mode,
        page_table,
        token_slot,
        slot_token,
        lru_order,
        hit_flag,
        out_slots,
        out_miss_src,
        out_miss_dst,
        out_miss_count,
        out_miss_count if out_miss_rows is None else out_miss_rows,
        out_miss_src if out_counts is None else out_counts,
        out_miss_src if out_totals is None else out_totals,
        *plan_args(shared, out_miss_src),
        layer,
        k,
        R,
        C,
        B,
        page_table.shape[1],
        L=L,
        P=page_size,
        W=W,
        G=G,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        ROWS_OUT=out_miss_rows is not None,
        COUNTS=out_counts is not None,
        TOTALS=out_totals is not None,
        SHARED=shared is not None,
        HOST_FALLBACK=host_fallback,
        num_warps=num_warps or (NUM_WARPS_LARGE if max(block_n, G * k) >= 2048 else 4),
    )
    if shared is not None:
        after_plan(layer, shared)
