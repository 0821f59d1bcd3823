"""Building blocks of the exact top-k (kernels/topk.py): order-preserving 32-bit keys, digit
histograms over a range of positions, bucket picking, and ascending-order compaction.

Ranks inside a chunk come from a matrix product with a triangular 0/1 matrix (exact in
fp16 x fp16 -> fp32), far cheaper than tl.cumsum across warps. Everything is integer counting:
results never depend on the order in which programs run.
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def signed_key(x):
    """int32 whose signed order is the order of fp32 x; NaN counts as -inf, -0.0 as +0.0."""
    bits = x.to(tl.int32, bitcast=True)
    # Canonicalize on the bits: float compares against 0.0 or NaN may be folded away.
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, -8388608, bits)  # NaN -> bits of -inf
    bits = tl.where(bits == INT32_MIN, 0, bits)  # -0.0 -> +0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def load_scores(row_ptr, offs, n_load):
    """Loads run to n_load >= n, a multiple of 4 when the row allows it, so the compiler can
    prove 16-byte vector loads; positions >= n are masked by the callers."""
    return tl.load(row_ptr + offs, mask=offs < n_load, other=0.0)


@triton.jit
def digit_histogram(
    row_ptr, start, stop, n_load, pref, lo, shift, NBINS: tl.constexpr, BLOCK: tl.constexpr
):
    """Histogram over positions [start, stop) of bits [shift, shift + log2 NBINS) of the
    unsigned keys whose bits >= lo equal those of pref (all keys when lo == 32)."""
    hist = tl.zeros([NBINS], tl.int32)
    # Arithmetic shifts of both sides keep the comparison exact for any prefix length < 32.
    hi = tl.minimum(lo, 31)
    offs = start + tl.arange(0, BLOCK)
    x = load_scores(row_ptr, offs, n_load)
    for _ in range(start, stop, BLOCK):
        # Load the next chunk before working on this one: few programs per SM, few warps to
        # hide the load latency behind.
        x_next = load_scores(row_ptr, offs + BLOCK, n_load)
        ukey = signed_key(x) ^ INT32_MIN
        match = (offs < stop) & ((lo == 32) | ((ukey >> hi) == (pref >> hi)))
        hist += tl.histogram((ukey >> shift) & (NBINS - 1), NBINS, mask=match)
        offs += BLOCK
        x = x_next
    return hist


@triton.jit
def pick_bucket(hist, k_rem, NBINS: tl.constexpr):
    """The bucket holding the k_rem-th largest key, the keys above it, and its size."""
    bins = tl.arange(0, NBINS)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    d = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > d, hist, 0), axis=0)
    size = tl.sum(tl.where(bins == d, hist, 0), axis=0)
    return d, above, size


@triton.jit
def inclusive_count(flags, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Row-major inclusive prefix count of 0/1 flags [ROWS, WIDTH], and their total."""
    c = tl.arange(0, WIDTH)
    upper = (c[:, None] <= c[None, :]).to(tl.float16)
    within = tl.dot(flags.to(tl.float16), upper).to(tl.int32)
    row_total = tl.sum(flags, axis=1)
    r = tl.arange(0, ROWS)
    before = tl.sum(tl.where(r[None, :] < r[:, None], row_total[None, :], 0), axis=1)
    return within + before[:, None], tl.sum(row_total, axis=0)


@triton.jit
def write_selected(
    row_ptr,
    out_ptr,
    start,
    stop,
    n_load,
    thr,
    take,
    PARTIAL_TIES: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Writes the selected positions of [start, stop) in ascending order from out_ptr on: keys
    > thr, and keys == thr (all of them, or the first `take` with PARTIAL_TIES). Returns how
    many."""
    n_sel = stop * 0
    n_eq = stop * 0
    offs = start + tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    x = load_scores(row_ptr, offs, n_load)
    for _ in range(start, stop, ROWS * WIDTH):
        x_next = load_scores(row_ptr, offs + ROWS * WIDTH, n_load)
        key = signed_key(x)
        valid = offs < stop
        if PARTIAL_TIES:
            eq = valid & (key == thr)
            eq_rank, eq_total = inclusive_count(eq.to(tl.int32), ROWS, WIDTH)
            sel = (valid & (key > thr)) | (eq & (n_eq + eq_rank <= take))
            n_eq += eq_total
        else:
            sel = valid & (key >= thr)
        sel_rank, sel_total = inclusive_count(sel.to(tl.int32), ROWS, WIDTH)
        tl.store(out_ptr + n_sel + sel_rank - 1, offs, mask=sel)
        n_sel += sel_total
        offs += ROWS * WIDTH
        x = x_next
    return n_sel


@triton.jit
def pad_tail(out_ptr, start, stop, n_sel, BLOCK: tl.constexpr):
    """out[j] = -1 for j in [max(start, n_sel), stop)."""
    first = tl.maximum(start, n_sel)
    for blk in range(first // BLOCK * BLOCK, stop, BLOCK):
        offs = blk + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, -1, mask=(offs >= first) & (offs < stop))
