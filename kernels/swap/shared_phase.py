"""The swap plan's shared phase in Triton (issue 40): the rows of cached prefix pages a call
selects are served from the shared region exactly as kernels/reference/shared_swap.py does (the
same slots, copies, spills, `key`, `last` and `order`; the index's layout may differ, never what
it finds), in launches around the per-request plan (kernels/swap/plan.py, SHARED):

1. lookup (a program per request, kernels/swap/shared_table.py): hits pinned, misses claimed;
2. count (per request): the keys each request owns, ranked in entry order;
3. victims (one program, kernels/swap/shared_lru.py): owners ranked across requests in batch
   order, the LRU victims, the new order;
4. the plan (per request): `resolve` gives each entry its shared slot (a hit, or the victim of
   its key's rank) or -1 (not eligible, or spilled: the private plan serves it); owners write
   the slot's new key and copy the row;
5. finish (a few programs): claims emptied, the index rebuilt if any slot changed hands.

Only launches, no sync or allocation (the workspace is the region's SharedScratch), so the
whole plan can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.arg_specs import check_specs
from kernels.swap.shared_lru import shared_finish_kernel, shared_victims_kernel
from kernels.swap.shared_table import shared_count_kernel, shared_lookup_kernel

# Rows a victims/finish program walks at once, and the finish launch's programs: the index
# rebuild is S compare-and-swaps, the cleanup one store per claim.
BLOCK_S = 1024
FINISH_PROGRAMS = 16


@triton.jit
def resolve(
    b,
    i,
    in_k,
    t,
    r,
    layer,
    k,
    max_pages,
    S,
    out_slots_ptr,
    page_table_ptr,
    key_ptr,
    groups_ptr,
    meta_ptr,
    victims_ptr,
    claim_key_ptr,
    claim_owner_ptr,
    claim_rank_ptr,
    claims_ptr,
    L: tl.constexpr,
    P: tl.constexpr,
):
    """Each entry's shared slot (-1: the private plan's), whether it copies the row (the owner
    of a key given a slot) and from which flat host row. Owners write their key's slot and
    their claim's position (for the cleanup)."""
    enc = tl.load(out_slots_ptr + b.to(tl.int64) * k + i, mask=in_k, other=-1)
    claimed = in_k & (enc <= -2)
    cpos = -2 - enc
    owner = tl.load(claim_owner_ptr + cpos, mask=claimed, other=0)
    rank = tl.load(groups_ptr + owner // k, mask=claimed, other=0)
    rank += tl.load(claim_rank_ptr + cpos, mask=claimed, other=0)
    got = claimed & (rank < tl.load(meta_ptr + 1))
    v = tl.load(victims_ptr + rank, mask=got, other=-1)
    mine = claimed & (owner == b * k + i)
    tl.store(claims_ptr + rank, cpos, mask=mine)
    copier = got & mine
    key = tl.load(claim_key_ptr + cpos, mask=copier, other=-1)
    tl.store(key_ptr + layer * S + v, key, mask=copier)
    page = tl.load(page_table_ptr + r.to(tl.int64) * max_pages + t // P, mask=copier, other=0)
    src = (page.to(tl.int64) * L + layer) * P + t % P
    return tl.where(in_k & (enc >= 0), enc, tl.where(got, v, -1)), copier, src


def check_region(shared: Any, L: int, R: int, B: int, num_groups: int, entries: int) -> None:
    """The region's tensors against the plan's shapes, and room in its scratch for the call."""
    S, sc = shared.key.shape[1], shared.scratch
    i32, i64 = torch.int32, torch.int64
    specs = {
        "key": (shared.key, i64, (L, S)),
        "index": (shared.index, i32, (L, 2 * S)),
        "last": (shared.last, i64, (L, S)),
        "order": (shared.order, i32, (L, S)),
        "shared_len": (shared.shared_len, i32, (R,)),
        "step": (shared.step, i64, (1,)),
        "page_gen": (shared.page_gen, i32, tuple(shared.page_gen.shape)),
        "victims": (sc.victims, i32, (S,)),
        "meta": (sc.meta, i32, (2,)),
    }
    check_specs(specs)
    if S % B or not 0 <= shared.base <= R - S // B:
        raise ValueError(f"shared region of {S} slots at request slot {shared.base}, B={B} R={R}")
    if num_groups > sc.groups.numel() or entries > sc.claims.numel():
        raise ValueError(f"shared scratch too small for {num_groups} requests, {entries} entries")


def before_plan(layer: int, args: tuple, shared: Any, dims: dict) -> None:
    """Launches 1-3. args: the plan's (topk, seq_lens, req_slots, req_mode, page_table,
    token_slot, out_slots); dims: k, R, C, max_pages, n, G, P, W, BLOCK_K."""
    topk, seq_lens, req_slots, req_mode, page_table, token_slot, out_slots = args
    sc, S, n, G = shared.scratch, shared.key.shape[1], dims["n"], dims["G"]
    block_k = dims["BLOCK_K"]
    shared_lookup_kernel[(n,)](
        *(topk, seq_lens, req_slots, req_mode, page_table, token_slot),
        *(shared.key, shared.index, shared.last, shared.page_gen, shared.shared_len),
        *(shared.step, sc.claim_key, sc.claim_owner, out_slots),
        *(layer, dims["k"], dims["R"], dims["C"], dims["max_pages"], S, sc.claim_key.numel()),
        P=dims["P"],
        W=dims["W"],
        G=G,
        BLOCK_K=block_k,
    )
    shared_count_kernel[(n,)](
        out_slots, sc.claim_owner, sc.claim_rank, sc.groups, dims["k"], G=G, BLOCK_K=block_k
    )
    shared_victims_kernel[(1,)](
        *(sc.groups, shared.order, shared.last, shared.index, shared.step, sc.victims, sc.meta),
        *(layer, n, S),
        BLOCK=BLOCK_S,
        num_warps=8,
    )


def plan_args(shared: Any, stand_in: torch.Tensor) -> tuple:
    """The plan kernel's shared arguments; without a region, `stand_in` fills every pointer
    (the kernel's SHARED branch, compiled out, never reads them)."""
    if shared is None:
        return (stand_in,) * 8 + (0, 1)
    sc = shared.scratch
    return (
        *(shared.key, sc.groups, sc.meta, sc.victims),
        *(sc.claim_key, sc.claim_owner, sc.claim_rank, sc.claims),
        shared.base,
        shared.key.shape[1],
    )


def after_plan(layer: int, shared: Any) -> None:
    """Launch 5: the claims emptied, the index rebuilt."""
    sc, S = shared.scratch, shared.key.shape[1]
    programs = max(1, min(FINISH_PROGRAMS, triton.cdiv(S, BLOCK_S)))
    shared_finish_kernel[(programs,)](
        *(shared.key, shared.index, sc.meta, sc.claims, sc.claim_key, sc.claim_owner),
        *(layer, S),
        BLOCK=BLOCK_S,
    )
