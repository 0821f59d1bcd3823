"""Exact per-row top-k selection: radix select on order-preserving 32-bit keys, then compaction.

One program owns a batch row. Each radix pass streams the row once and histograms the next
RADIX_BITS bits of the keys that share the prefix found so far, which tells the bucket holding the
k-th largest key. When that bucket is taken whole, lower bits cannot change the selection and the
search stops early. A last pass writes the selected positions in ascending order; ties at the
threshold go to the lowest positions. Ranks inside a chunk come from a matrix product with a
triangular 0/1 matrix (exact in fp16 x fp16 -> fp32), far cheaper than tl.cumsum across warps.
No sort, no atomics, no scratch memory: the result is exact and deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def _signed_key(x):
    """int32 whose signed order is the order of fp32 x; NaN counts as -inf, -0.0 as +0.0."""
    bits = x.to(tl.int32, bitcast=True)
    # Canonicalize on the bits: float compares against 0.0 or NaN may be folded away.
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, -8388608, bits)   # NaN -> bits of -inf
    bits = tl.where(bits == _INT32_MIN, 0, bits)                         # -0.0 -> +0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_scores(row_ptr, offs, n_load):
    """Loads run to n_load >= n, a multiple of 4 when the row allows it, so the compiler can
    prove 16-byte vector loads; positions >= n are masked by the callers."""
    return tl.load(row_ptr + offs, mask=offs < n_load, other=0.0)


@triton.jit
def _digit_histogram(row_ptr, n, n_load, pref, lo, shift, NBINS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Histogram of bits [shift, shift + log2 NBINS) of the unsigned keys whose bits >= lo equal
    those of pref (all keys when lo == 32)."""
    hist = tl.zeros([NBINS], tl.int32)
    # Arithmetic shifts of both sides keep the comparison exact for any prefix length < 32.
    hi = tl.minimum(lo, 31)
    offs = tl.arange(0, BLOCK)
    x = _load_scores(row_ptr, offs, n_load)
    for _ in range(0, n, BLOCK):
        # Load the next chunk before working on this one: one program per SM has no other
        # warps to hide the load latency behind.
        x_next = _load_scores(row_ptr, offs + BLOCK, n_load)
        ukey = _signed_key(x) ^ _INT32_MIN
        match = (offs < n) & ((lo == 32) | ((ukey >> hi) == (pref >> hi)))
        hist += tl.histogram((ukey >> shift) & (NBINS - 1), NBINS, mask=match)
        offs += BLOCK
        x = x_next
    return hist


@triton.jit
def _pick_bucket(hist, k_rem, NBINS: tl.constexpr):
    """The bucket holding the k_rem-th largest key, the keys above it, and its size."""
    bins = tl.arange(0, NBINS)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    d = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > d, hist, 0), axis=0)
    size = tl.sum(tl.where(bins == d, hist, 0), axis=0)
    return d, above, size


@triton.jit
def _radix_threshold(row_ptr, n, n_load, k, RADIX_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Signed key t, count `take` and `tied` >= take such that the selection is: keys > t, then
    the first `take` of the `tied` keys == t by position. With n <= k every position is taken."""
    pref = n * 0            # unsigned-order key bits found so far (bits >= lo)
    k_rem = k
    size = k
    lo = tl.where(n > k, 32, 0)
    while lo > 0:
        shift = tl.maximum(lo - RADIX_BITS, 0)
        hist = _digit_histogram(row_ptr, n, n_load, pref, lo, shift, 1 << RADIX_BITS, BLOCK)
        d, above, size = _pick_bucket(hist, k_rem, 1 << RADIX_BITS)
        k_rem -= above
        # Bits below shift and above lo overlap in the last, narrower pass; d repeats them.
        pref = pref | (d << shift)
        # A bucket taken whole needs no lower bits: keys >= its smallest possible key are in.
        lo = tl.where(size == k_rem, 0, shift)
    # After an early stop the bucket is taken whole; `size` then equals k_rem.
    return pref ^ _INT32_MIN, k_rem, size


@triton.jit
def _inclusive_count(flags, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Row-major inclusive prefix count of 0/1 flags [ROWS, WIDTH], and their total."""
    c = tl.arange(0, WIDTH)
    upper = (c[:, None] <= c[None, :]).to(tl.float16)
    within = tl.dot(flags.to(tl.float16), upper).to(tl.int32)
    row_total = tl.sum(flags, axis=1)
    r = tl.arange(0, ROWS)
    before = tl.sum(tl.where(r[None, :] < r[:, None], row_total[None, :], 0), axis=1)
    return within + before[:, None], tl.sum(row_total, axis=0)


@triton.jit
def _write_selected(row_ptr, out_ptr, n, n_load, thr, take, PARTIAL_TIES: tl.constexpr,
                    ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Writes the selected positions in ascending order; returns how many."""
    n_sel = n * 0
    n_eq = n * 0
    offs = tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    x = _load_scores(row_ptr, offs, n_load)
    for _ in range(0, n, ROWS * WIDTH):
        x_next = _load_scores(row_ptr, offs + ROWS * WIDTH, n_load)
        key = _signed_key(x)
        valid = offs < n
        if PARTIAL_TIES:
            eq = valid & (key == thr)
            eq_rank, eq_total = _inclusive_count(eq.to(tl.int32), ROWS, WIDTH)
            sel = (valid & (key > thr)) | (eq & (n_eq + eq_rank <= take))
            n_eq += eq_total
        else:
            sel = valid & (key >= thr)
        sel_rank, sel_total = _inclusive_count(sel.to(tl.int32), ROWS, WIDTH)
        tl.store(out_ptr + n_sel + sel_rank - 1, offs, mask=sel)
        n_sel += sel_total
        offs += ROWS * WIDTH
        x = x_next
    return n_sel


@triton.jit
def _pad_tail(out_ptr, n_sel, k, BLOCK: tl.constexpr):
    for start in range(n_sel // BLOCK * BLOCK, k, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, -1, mask=(offs >= n_sel) & (offs < k))


@triton.jit
def _topk_kernel(scores_ptr, seq_lens_ptr, out_ptr, C, K, s_sc_b, s_o_b,
                 RADIX_BITS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                 PAD_LOADS: tl.constexpr):
    b = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), C)
    n_load = (n + 3) // 4 * 4 if PAD_LOADS else n
    row_ptr = scores_ptr + b.to(tl.int64) * s_sc_b
    out_ptr += b.to(tl.int64) * s_o_b
    thr, take, tied = _radix_threshold(row_ptr, n, n_load, K, RADIX_BITS, ROWS * WIDTH)
    # Splitting ties by position costs a second prefix count; most rows take every tied key.
    if take < tied:
        n_sel = _write_selected(row_ptr, out_ptr, n, n_load, thr, take, True, ROWS, WIDTH)
    else:
        n_sel = _write_selected(row_ptr, out_ptr, n, n_load, thr, take, False, ROWS, WIDTH)
    _pad_tail(out_ptr, n_sel, K, ROWS * WIDTH)


def topk_select(scores: torch.Tensor, seq_lens: torch.Tensor, out_topk: torch.Tensor, *,
                radix_bits: int = 6, rows: int = 32, width: int = 128,
                num_warps: int = 16) -> None:
    """The k = out_topk.shape[1] highest scores of each row among positions < seq_len.

    scores [bs, C] fp32 (NaN counts as -inf, -0.0 as +0.0), seq_lens [bs] int32 (clamped to
    [0, C]), out_topk [bs, k] int32: the selected positions in ascending order, ties to the lower
    position, padded with -1 when seq_len < k. Rows are streamed in chunks of rows * width.
    Allocates nothing and never synchronizes.
    """
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(-1) != 1:
        raise ValueError(f"scores: expected [bs, C] fp32 with unit last stride, got "
                         f"{tuple(scores.shape)} {scores.dtype}")
    bs, cols = scores.shape
    if seq_lens.shape != (bs,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens: expected [{bs}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if out_topk.dim() != 2 or out_topk.shape[0] != bs or out_topk.dtype != torch.int32 \
            or out_topk.stride(-1) != 1:
        raise ValueError(f"out_topk: expected [{bs}, k] int32 with unit last stride, got "
                         f"{tuple(out_topk.shape)} {out_topk.dtype}")
    if not 1 <= radix_bits <= 11 or min(rows, width) < 16 or rows & (rows - 1) or width & (width - 1):
        raise ValueError("radix_bits must be in [1, 11]; rows and width powers of two >= 16")
    if bs == 0 or out_topk.shape[1] == 0:
        return
    # Reading up to 3 positions past seq_len is safe when every row holds a multiple of 4 floats.
    pad_loads = cols % 4 == 0 and scores.stride(0) % 4 == 0
    _topk_kernel[(bs,)](scores, seq_lens, out_topk, cols, out_topk.shape[1], scores.stride(0),
                        out_topk.stride(0), RADIX_BITS=radix_bits, ROWS=rows, WIDTH=width,
                        PAD_LOADS=pad_loads, num_warps=num_warps)
