"""Swap-in plan: per (layer, request) find the hits of a top-k selection and give each miss an
LRU victim slot. Semantics and tensor layout: docs/ARCHITECTURE.md ("Plan semantics").

One program per batch row. A resident request's row maps position t to slot t; an offloaded
one's does O(B + k) work in three phases separated by barriers (kernels/lru_plan.py):
1. look up each position (window ring, `token_slot`), mark LRU hits in `hit_flag`;
2. stable-partition `lru_order` into (kept, hits, victims) with prefix sums and scatter it back;
3. read each miss's victim from the tail of the new order, update residency, emit the miss list.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels.interpreter  # noqa: F401  (the interpreter switch, before any @triton.jit)
from kernels import formats
from kernels.lru_plan import plan_offloaded

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
    layer,
    k,
    R,
    C,
    B,
    max_pages,
    L: tl.constexpr,
    P: tl.constexpr,
    W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.load(req_slots_ptr + b)
    r_ok = (r >= 0) & (r < R)
    mode = tl.load(req_mode_ptr + r, mask=r_ok, other=0)
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), C)
    i = tl.arange(0, BLOCK_K)
    in_k = i < k
    t = tl.load(topk_ptr + b.to(tl.int64) * k + i, mask=in_k, other=-1)
    if mode == MODE_OFFLOADED:
        plan_offloaded(
            layer,
            b,
            k,
            i,
            t,
            in_k,
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
            R,
            C,
            B,
            max_pages,
            L,
            P,
            W,
            BLOCK_N,
        )
    else:
        # Resident: token t is hot slot t. Free slots and padding rows select nothing.
        ok = (mode == MODE_RESIDENT) & (t >= 0) & (t < tl.minimum(seq_len, B))
        tl.store(out_slots_ptr + b.to(tl.int64) * k + i, tl.where(ok, t, -1), mask=in_k)
        tl.store(out_count_ptr + b, 0)


def _check(specs: dict) -> None:
    # Shapes guard every flat address the kernel computes; a device mix-up fails at launch.
    for name, (x, dtype, shape) in specs.items():
        if x.dtype is not dtype or x.shape != shape or not x.is_contiguous():
            raise ValueError(
                f"{name}: expected contiguous {tuple(shape)} {dtype}, "
                f"got {tuple(x.shape)} {x.dtype}"
            )


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
    num_warps: int | None = None,
) -> None:
    """Plan one layer's swap-in for a batch; updates residency state in place.

    topk [bs, k] int32 (entries < 0 or >= seq_len are skipped; valid entries of a row must be
    distinct: a repeated miss would get two victims and orphan one; the engine's top-k never
    repeats, and remote swap refuses rows that do), seq_lens [bs] int32,
    req_slots [bs] int32 (-1: padding row), req_mode [R] int32, page_table [R, max_pages] int32,
    token_slot [L, R, C] int32, slot_token [L, R, B] int32, lru_order [L, R, B - W] int32,
    hit_flag [R, B] int8 (zero before and after).
    Outputs: out_slots [bs, k] int32, out_miss_src / out_miss_dst [bs, k] int64 (flat host row,
    flat hot row; entries at j >= out_miss_count[b] are left untouched), out_miss_count [bs] int32.
    Launch-only (no sync, no allocation), so it can be captured in a CUDA graph.
    """
    (bs, k), (L, R, C), B, W = topk.shape, token_slot.shape, slot_token.shape[2], window
    if num_layers != L or not 0 <= layer < L:
        raise ValueError(f"layer {layer} / num_layers {num_layers} do not match token_slot {L}")
    if not 1 <= W < B or k > B - W or page_table.shape[1] * page_size < C:
        raise ValueError(
            f"need 1 <= W < B, k <= B - W, max_pages * P >= C: W={W} B={B} k={k} "
            f"page_table {tuple(page_table.shape)} P={page_size} C={C}"
        )
    i32, i64 = torch.int32, torch.int64
    _check(
        {
            "topk": (topk, i32, (bs, k)),
            "seq_lens": (seq_lens, i32, (bs,)),
            "req_slots": (req_slots, i32, (bs,)),
            "req_mode": (req_mode, i32, (R,)),
            "page_table": (page_table, i32, (R, page_table.shape[1])),
            "token_slot": (token_slot, i32, (L, R, C)),
            "slot_token": (slot_token, i32, (L, R, B)),
            "lru_order": (lru_order, i32, (L, R, B - W)),
            "hit_flag": (hit_flag, torch.int8, (R, B)),
            "out_slots": (out_slots, i32, (bs, k)),
            "out_miss_src": (out_miss_src, i64, (bs, k)),
            "out_miss_dst": (out_miss_dst, i64, (bs, k)),
            "out_miss_count": (out_miss_count, i32, (bs,)),
        }
    )
    if bs == 0:
        return
    block_n = max(16, triton.next_power_of_2(B - W))
    _swap_plan_kernel[(bs,)](
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
        layer,
        k,
        R,
        C,
        B,
        page_table.shape[1],
        L=L,
        P=page_size,
        W=W,
        BLOCK_K=max(16, triton.next_power_of_2(k)),
        BLOCK_N=block_n,
        num_warps=num_warps or (NUM_WARPS_LARGE if block_n >= 2048 else 4),
    )
