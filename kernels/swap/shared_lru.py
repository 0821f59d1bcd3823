"""The shared region's LRU in Triton (the swap plan's shared phase, issue 40; rules:
kernels/reference/shared_swap.py): the victims of a call and the region's order, then the
cleanup after the plan.

`order` [L, S] holds the slots sorted by (last read step, slot id). After the lookups pinned
their hits (last = step), the victims are the first M unpinned slots of that order (M: the
call's missed keys, capped by the unpinned slots), and the new order is the unpinned slots left,
in their old order, followed by every slot read at this step, by slot id: both parts stay sorted
by (last, slot), so the order never needs a sort, only prefix sums over S. One program does it
(it is O(S) with a few passes, and a call's victims must be ranked across every request).
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.swap.shared_table import table_insert

INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _offsets(groups_ptr, n, BLOCK: tl.constexpr):
    """Turn the per-group owner counts into exclusive offsets, in place; return the total."""
    j = tl.arange(0, BLOCK)
    total = 0
    for c in range(0, n, BLOCK):
        x = tl.load(groups_ptr + c + j, mask=c + j < n, other=0)
        tl.store(groups_ptr + c + j, total + tl.cumsum(x, 0) - x, mask=c + j < n)
        total += tl.sum(x, 0)
    return total


@triton.jit(do_not_specialize=["layer"])
def shared_victims_kernel(
    groups_ptr,
    order_ptr,
    last_ptr,
    index_ptr,
    step_ptr,
    victims_ptr,
    meta_ptr,
    layer,
    n,
    S,
    BLOCK: tl.constexpr,
):
    """One program: the owners' offsets per group, the victims (the last step of each set
    to now: they are read at this step), the new order; the index emptied for its rebuild
    when any slot changes hands. meta = (owners, owners given a slot)."""
    owners = _offsets(groups_ptr, n, BLOCK)
    step = tl.load(step_ptr)
    order, last = order_ptr + layer * S, last_ptr + layer * S
    j = tl.arange(0, BLOCK)
    unpinned = 0
    for c in range(0, S, BLOCK):
        seen = tl.load(last + c + j, mask=c + j < S, other=step)
        unpinned += tl.sum((seen != step).to(tl.int32), 0)
    m = tl.minimum(owners, unpinned)
    ranked = 0
    for c in range(0, S, BLOCK):
        ok = c + j < S
        o = tl.load(order + c + j, mask=ok, other=0)
        free = (ok & (tl.load(last + o, mask=ok, other=step) != step)).to(tl.int32)
        rank = ranked + tl.cumsum(free, 0) - free
        # The chunk is read before any of it is overwritten; kept slots move to rank - m <= its
        # own position, never past the chunk.
        tl.debug_barrier()
        victim = (free != 0) & (rank < m)
        tl.store(victims_ptr + rank, o, mask=victim)
        tl.store(last + o, step, mask=victim)
        tl.store(order + rank - m, o, mask=(free != 0) & (rank >= m))
        ranked += tl.sum(free, 0)
    tl.debug_barrier()
    pinned = unpinned - m
    for c in range(0, S, BLOCK):
        now = ((c + j < S) & (tl.load(last + c + j, mask=c + j < S, other=0) == step)).to(tl.int32)
        tl.store(order + pinned + tl.cumsum(now, 0) - now, c + j, mask=now != 0)
        pinned += tl.sum(now, 0)
    if m > 0:
        for c in range(0, 2 * S, BLOCK):
            tl.store(index_ptr + layer * 2 * S + c + j, -1, mask=c + j < 2 * S)
    tl.store(meta_ptr, owners)
    tl.store(meta_ptr + 1, m)


@triton.jit(do_not_specialize=["layer"])
def shared_finish_kernel(
    key_ptr,
    index_ptr,
    meta_ptr,
    claims_ptr,
    claim_key_ptr,
    claim_owner_ptr,
    layer,
    S,
    BLOCK: tl.constexpr,
):
    """After the plan, over a few programs: the call's claims emptied (their positions are in
    `claims`, by rank), and the index rebuilt from `key` when slots changed hands."""
    p, programs = tl.program_id(0), tl.num_programs(0)
    owners = tl.load(meta_ptr)
    j = tl.arange(0, BLOCK)
    c = p * BLOCK
    while c < owners:
        ok = c + j < owners
        pos = tl.load(claims_ptr + c + j, mask=ok, other=0)
        tl.store(claim_key_ptr + pos, -1, mask=ok)
        tl.store(claim_owner_ptr + pos, INT32_MAX, mask=ok)
        c += programs * BLOCK
    if tl.load(meta_ptr + 1) > 0:
        c = p * BLOCK
        while c < S:
            ok = c + j < S
            key = tl.load(key_ptr + layer * S + c + j, mask=ok, other=-1)
            table_insert(index_ptr + layer * 2 * S, key, c + j, ok & (key >= 0), 2 * S)
            c += programs * BLOCK
