"""The shared region's two hash tables in Triton (the swap plan's shared phase, issue 40; rules:
kernels/reference/shared_swap.py), and the phase's two per-request kernels.

- The region's index [2S] (open addressing, linear probing, a table entry is a slot whose `key`
  names its row): looked up by every eligible entry of a call at once, read-only; rebuilt from
  `key` after a call that changed it (kernels/swap/shared_lru.py), by parallel compare-and-swap
  inserts, so no deletion ever runs concurrently. The layout of the entries then depends on the
  order the inserts land in, never what a lookup finds: every key sits after an unbroken run of
  occupied entries from its home, as the reference's back-shift deletion keeps it too.
- The claim table (SharedScratch, empty between calls): each missed key of a call is entered
  once by compare-and-swap, and its owner is the smallest flat entry index (group * G k + entry)
  that missed it, an atomic minimum, so the first occurrence in batch order owns it (copies the
  row) whichever program gets there first.
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels import formats
from kernels.swap.entries import group_entries

MODE_OFFLOADED = tl.constexpr(formats.MODE_OFFLOADED)


@triton.jit
def table_home(key, size):
    """The reference's probe start: a 32x32-bit multiplicative hash of the key's two halves
    (int64 products wrap, which leaves the low 32 bits exact)."""
    x = (key & 0xFFFFFFFF) ^ (key >> 32)
    return ((x * 0x9E3779B1) & 0xFFFFFFFF) % size


@triton.jit
def table_lookup(index_ptr, key_ptr, key, active, T):
    """The slot holding each active key, or -1: probe from its home to the first empty entry."""
    pos = table_home(key, T)
    found = tl.zeros_like(pos).to(tl.int32) - 1
    while tl.max(active.to(tl.int32), 0) > 0:
        e = tl.load(index_ptr + pos, mask=active, other=-1)
        held = tl.load(key_ptr + e, mask=active & (e >= 0), other=-1)
        hit = active & (e >= 0) & (held == key)
        found = tl.where(hit, e, found)
        active = active & (e >= 0) & ~hit
        pos = tl.where(active, (pos + 1) % T, pos)
    return found


@triton.jit
def table_insert(index_ptr, key, slot, active, T):
    """Enter each active slot at the first empty entry from its key's home. Inactive lanes
    compare against -2, which no entry holds, so their compare-and-swap writes nothing."""
    pos = table_home(key, T)
    while tl.max(active.to(tl.int32), 0) > 0:
        cmp = tl.where(active, -1, -2).to(tl.int32)
        old = tl.atomic_cas(index_ptr + tl.where(active, pos, 0), cmp, slot)
        active = active & (old != -1)
        pos = tl.where(active, (pos + 1) % T, pos)


@triton.jit
def claim(claim_key_ptr, claim_owner_ptr, key, active, flat, T):
    """Each active key's claim table entry (entered if new), its owner lowered to `flat`."""
    pos = table_home(key, T)
    found = pos
    while tl.max(active.to(tl.int32), 0) > 0:
        cmp = tl.where(active, -1, -2).to(tl.int64)
        old = tl.atomic_cas(claim_key_ptr + tl.where(active, pos, 0), cmp, key)
        done = active & ((old == -1) | (old == key))
        tl.atomic_min(claim_owner_ptr + pos, flat, mask=done)
        found = tl.where(done, pos, found)
        active = active & ~done
        pos = tl.where(active, (pos + 1) % T, pos)
    return found


@triton.jit(do_not_specialize=["layer"])
def shared_lookup_kernel(
    topk_ptr,
    seq_lens_ptr,
    req_slots_ptr,
    req_mode_ptr,
    page_table_ptr,
    token_slot_ptr,
    key_ptr,
    index_ptr,
    last_ptr,
    page_gen_ptr,
    shared_len_ptr,
    step_ptr,
    claim_key_ptr,
    claim_owner_ptr,
    out_slots_ptr,
    layer,
    k,
    R,
    C,
    max_pages,
    S,
    Tc,
    P: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per request (program): its eligible entries (offloaded, below its shared length and
    outside the window, not privately resident, page mapped) looked up; a hit pins its slot
    (last = step), a miss is claimed. Each entry's outcome goes to out_slots for the next
    launches: the slot of a hit, -2 - claim position of a miss, -1 for the private plan."""
    b = tl.program_id(0)
    r, r_ok, mode, i, in_k, t, row_len = group_entries(
        b, topk_ptr, seq_lens_ptr, req_slots_ptr, req_mode_ptr, k, R, C, G, BLOCK_K
    )
    below = tl.minimum(tl.load(shared_len_ptr + r, mask=r_ok, other=0), tl.max(row_len, 0) - W)
    # Only offloaded requests share (a scalar test folded into `below`: the interpreter turns
    # a block & a scalar bool into int32, which it then refuses as a mask).
    below = tl.where(mode == MODE_OFFLOADED, below, 0)
    cand = in_k & (t >= 0) & (t < row_len) & (t < below)
    ts = tl.load(token_slot_ptr + (layer * R + r).to(tl.int64) * C + t, mask=cand, other=0)
    page = tl.load(page_table_ptr + r.to(tl.int64) * max_pages + t // P, mask=cand, other=-1)
    elig = cand & (ts < 0) & (page >= 0)
    gen = tl.load(page_gen_ptr + page, mask=elig, other=0).to(tl.int64)
    key = (gen << 32) | (page.to(tl.int64) * P + t % P)
    slot = table_lookup(index_ptr + layer * 2 * S, key_ptr + layer * S, key, elig, 2 * S)
    hit = elig & (slot >= 0)
    tl.store(last_ptr + layer * S + slot, tl.load(step_ptr), mask=hit)
    miss = elig & ~hit
    cpos = claim(claim_key_ptr, claim_owner_ptr, key, miss, (b * G * k + i).to(tl.int32), Tc)
    enc = tl.where(hit, slot, tl.where(miss, -2 - cpos.to(tl.int32), -1))
    tl.store(out_slots_ptr + b.to(tl.int64) * G * k + i, enc, mask=in_k)


@triton.jit
def shared_count_kernel(
    out_slots_ptr,
    claim_owner_ptr,
    claim_rank_ptr,
    groups_ptr,
    k,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per request: the keys it owns (first occurrences), each with its rank among them in
    entry order, and how many."""
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_K)
    in_k = i < G * k
    enc = tl.load(out_slots_ptr + b.to(tl.int64) * G * k + i, mask=in_k, other=-1)
    claimed = in_k & (enc <= -2)
    cpos = -2 - enc
    owner = tl.load(claim_owner_ptr + cpos, mask=claimed, other=-1)
    mine = (claimed & (owner == b * G * k + i)).to(tl.int32)
    tl.store(claim_rank_ptr + cpos, tl.cumsum(mine, 0) - mine, mask=mine != 0)
    tl.store(groups_ptr + b, tl.sum(mine, 0))
