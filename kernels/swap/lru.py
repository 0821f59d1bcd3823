"""The swap-in plan of one offloaded (layer, request), the three phases of kernels/swap/plan.py's
program for such a request, separated by barriers:
1. `_lookup`: each position's hot slot (window ring, `token_slot`), LRU hits marked in `hit_flag`;
   `_claim` keeps the first occurrence of each missed position (a row's repeats, and with several
   rows per request, a speculative verify's, the union), so every missed position gets one
   victim and is copied once;
2. `_reorder`: `lru_order` stable-partitioned into (kept, hits, victims) with prefix sums;
3. `plan_offloaded`: each miss's victim from the tail of the new order, residency updated, the
   miss list emitted; repeated misses read their first occurrence's slot (HOST_FALLBACK: misses
   past the victims, and their repeats, read their host rows, -2 - row).
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.swap.shared_phase import resolve


@triton.jit
def _lookup(
    t,
    in_k,
    row_len,
    seq_len,
    r,
    res_base,
    page_table_ptr,
    token_slot_ptr,
    hit_flag_ptr,
    C,
    B,
    max_pages,
    P: tl.constexpr,
    W: tl.constexpr,
):
    # row_len: the length of each entry's own row (validity); seq_len: the request's (window).
    valid = in_k & (t >= 0) & (t < row_len)
    win = valid & (t >= seq_len - W)
    old = valid & (t < seq_len - W)
    # Both gathers depend only on t, so they are in flight together.
    ts = tl.load(token_slot_ptr + res_base * C + t, mask=old, other=-1)
    page = tl.load(page_table_ptr + r.to(tl.int64) * max_pages + t // P, mask=old, other=-1)
    hit = old & (ts >= W) & (ts < B)
    # A position without a mapped page has no host row to copy from: skip it like a bad index.
    miss = old & ~hit & (page >= 0)
    tl.store(hit_flag_ptr + r.to(tl.int64) * B + ts, 1, mask=hit)
    slots = tl.where(win, t % W, tl.where(hit, ts, -1))
    return slots, ts, page, hit, miss


@triton.jit
def _claim(t, miss, i, ts_row, BLOCK_K: tl.constexpr):
    """Split the misses into first occurrences (owners) and repeats. Each missed position's
    `token_slot` entry (not an LRU slot, so free to use until the owner writes its victim there)
    takes the smallest claim of the entries naming it: claims are negative, below -1, and grow
    with the entry index, so the first occurrence wins. O(entries), no sort."""
    claim = i - BLOCK_K - 1
    tl.atomic_min(ts_row + t, claim, mask=miss)
    # Every claim has landed before any entry reads the winner.
    tl.debug_barrier()
    won = tl.load(ts_row + t, mask=miss, other=0) == claim
    return miss & won, miss & ~won


@triton.jit
def _reorder(
    m,
    r,
    res_base,
    lru_order_ptr,
    hit_flag_ptr,
    slot_token_ptr,
    token_slot_ptr,
    C,
    B,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rewrite lru_order as (kept, hits, victims); return m, capped by the non-hit slots."""
    n = B - W
    j = tl.arange(0, BLOCK_N)
    in_n = j < n
    lru = lru_order_ptr + res_base * n
    o = tl.load(lru + j, mask=in_n, other=-1)
    o_ok = in_n & (o >= 0) & (o < B)
    h = tl.load(hit_flag_ptr + r.to(tl.int64) * B + o, mask=o_ok, other=0) != 0
    h_i = h.to(tl.int32)
    nh_i = (in_n & ~h).to(tl.int32)
    hit_rank = tl.cumsum(h_i, 0) - h_i
    nh_rank = tl.cumsum(nh_i, 0) - nh_i
    num_hit = tl.sum(h_i, 0)
    m = tl.minimum(m, n - num_hit)
    victim = (nh_i != 0) & (nh_rank < m)
    pos = tl.where(h, n - num_hit - m + hit_rank, tl.where(victim, n - m + nh_rank, nh_rank - m))
    evicted = tl.load(slot_token_ptr + res_base * B + o, mask=victim & o_ok, other=-1)
    # Every thread must have read the old order before anyone overwrites it.
    tl.debug_barrier()
    tl.store(lru + pos, o, mask=in_n)
    gone = victim & (evicted >= 0) & (evicted < C)
    tl.store(token_slot_ptr + res_base * C + evicted, -1, mask=gone)
    return m


@triton.jit
def plan_offloaded(
    layer,
    b,
    k,
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
    L: tl.constexpr,
    P: tl.constexpr,
    W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_OUT: tl.constexpr,
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
    SHARED: tl.constexpr,
    HOST_FALLBACK: tl.constexpr,
):
    """b: the program's request (group of rows); k: its entries (rows x top-k); entry i of
    position t belongs to a row of length row_len[i]; seq_len: the request's length. Returns
    (missed positions: those copied, and with HOST_FALLBACK those read from the host; missed
    entries with repeats counted).
    HOST_FALLBACK: a missed position left without a victim (G k > B - W) is read from the
    host tier: its entries, repeats included, get -2 - (its flat host row); no copy, and it
    does not become resident.
    SHARED: launches 1-3 of kernels/swap/shared_phase.py ran; entries the region serves leave
    the private plan (t = -1), their slots are written relative to this request's buffer,
    (base - r) B + shared slot, and the copies they own follow the private ones in the miss
    list, as the reference orders them."""
    if SHARED:
        sh, copier, src_sh = resolve(
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
            L,
            P,
        )
        t = tl.where(sh >= 0, -1, t)
    res_base = (layer * R + r).to(tl.int64)
    ts_row = token_slot_ptr + res_base * C
    slots, ts, page, hit, miss = _lookup(
        t,
        in_k,
        row_len,
        seq_len,
        r,
        res_base,
        page_table_ptr,
        token_slot_ptr,
        hit_flag_ptr,
        C,
        B,
        max_pages,
        P,
        W,
    )
    # Every missed entry, repeats counted (what planning each row alone would copy, when rows
    # hold distinct positions): the dedup's baseline.
    row_misses = tl.sum(miss.to(tl.int32), 0)
    if SHARED:
        copy_i = copier.to(tl.int32)
        copies = tl.sum(copy_i, 0)
        row_misses += copies
    if ROWS_OUT:
        tl.store(out_rows_ptr + b, row_misses)
    # The lookup read token_slot before any claim overwrites it.
    tl.debug_barrier()
    miss, repeat = _claim(t, miss, i, ts_row, BLOCK_K)
    miss_i = miss.to(tl.int32)
    miss_rank = tl.cumsum(miss_i, 0) - miss_i
    m = tl.sum(miss_i, 0)
    if HOST_FALLBACK:
        owners = m
    tl.debug_barrier()
    m = _reorder(
        m,
        r,
        res_base,
        lru_order_ptr,
        hit_flag_ptr,
        slot_token_ptr,
        token_slot_ptr,
        C,
        B,
        W,
        BLOCK_N,
    )
    # Evictions (token_slot -> -1) must land before new residents are written.
    tl.debug_barrier()
    placed = miss & (miss_rank < m)
    # Victim j sits at position n - m + j of the order just written.
    v = tl.load(lru_order_ptr + res_base * (B - W) + (B - W - m) + miss_rank, mask=placed, other=-1)
    tl.store(slot_token_ptr + res_base * B + v, t, mask=placed & (v >= 0) & (v < B))
    tl.store(ts_row + t, v, mask=placed)
    tl.store(hit_flag_ptr + r.to(tl.int64) * B + ts, 0, mask=hit)
    slots = tl.where(placed, v, slots)
    # An owner left without a victim (never, while G k <= B - W: the wrapper's rule unless
    # HOST_FALLBACK) gives its claim back; repeats then read their owner's slot.
    tl.store(ts_row + t, -1, mask=miss & ~placed)
    tl.debug_barrier()
    if HOST_FALLBACK:
        # The host row, for an owner without a victim and its repeats (they read -1 back).
        host = (-2 - ((page.to(tl.int64) * L + layer) * P + t % P)).to(tl.int32)
        got = tl.load(ts_row + t, mask=repeat, other=-1)
        slots = tl.where(miss & ~placed, host, slots)
        slots = tl.where(repeat, tl.where(got == -1, host, got), slots)
    else:
        slots = tl.where(repeat, tl.load(ts_row + t, mask=repeat, other=-1), slots)
    if SHARED:
        slots = tl.where(sh >= 0, (base - r) * B + sh, slots)
    row = b.to(tl.int64) * k
    tl.store(out_slots_ptr + row + i, slots, mask=in_k)
    src = (page.to(tl.int64) * L + layer) * P + t % P
    tl.store(out_src_ptr + row + miss_rank, src, mask=placed)
    tl.store(out_dst_ptr + row + miss_rank, res_base * B + v, mask=placed)
    if SHARED:
        at = row + m + tl.cumsum(copy_i, 0) - copy_i
        tl.store(out_src_ptr + at, src_sh, mask=copier)
        tl.store(out_dst_ptr + at, (layer * R + base).to(tl.int64) * B + sh, mask=copier)
        m += copies
    tl.store(out_count_ptr + b, m)
    if HOST_FALLBACK:
        # The counters count host reads as misses: every missed position, copied or not.
        m += owners - tl.sum(placed.to(tl.int32), 0)
    return m, row_misses
