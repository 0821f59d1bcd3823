"""Exact per-row top-k selection: radix select on order-preserving 32-bit keys, then compaction.

Radix select: each pass histograms the next RADIX_BITS bits of the keys that share the prefix
found so far, which tells the bucket holding the k-th largest key. When that bucket is taken
whole, lower bits cannot change the selection and the search stops early. Compaction writes the
selected positions in ascending order; ties at the threshold go to the lowest positions.

Two schedules, same result bit for bit:
- single (no workspace): one program per row does every pass; only bs programs.
- segmented (`TopkWorkspace`): each row is cut into segments of `segment` positions, one program
  per (segment, row). A pass is one launch: every program stores its segment's histogram, and
  the last program of the row to finish (an integer arrival counter) sums them in segment order,
  picks the bucket and stores the row's state; once the threshold is known it also stores each
  segment's output offset. A last launch compacts every segment at its offset. All cross-program
  data are integer counts combined in a fixed order, so the output never depends on timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import kernels.interpreter  # noqa: F401  (the interpreter switch, before any @triton.jit)
from kernels.radix_select import INT32_MIN, digit_histogram, pad_tail, pick_bucket, write_selected

__all__ = ["TopkWorkspace", "topk_select"]

# Row state in TopkWorkspace.state: unsigned key bits found, rank left, bits left (0 = done),
# and whether only some keys equal to the threshold are taken.
_PREF, _K_REM, _LO, _PARTIAL = (tl.constexpr(i) for i in range(4))


@triton.jit
def _radix_threshold(row_ptr, n, n_load, k, RADIX_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Signed key t, count `take` and `tied` >= take such that the selection is: keys > t, then
    the first `take` of the `tied` keys == t by position. With n <= k every position is taken."""
    pref = n * 0  # unsigned-order key bits found so far (bits >= lo)
    k_rem = k
    size = k
    lo = tl.where(n > k, 32, 0)
    while lo > 0:
        shift = tl.maximum(lo - RADIX_BITS, 0)
        hist = digit_histogram(row_ptr, 0, n, n_load, pref, lo, shift, 1 << RADIX_BITS, BLOCK)
        d, above, size = pick_bucket(hist, k_rem, 1 << RADIX_BITS)
        k_rem -= above
        # Bits below shift and above lo overlap in the last, narrower pass; d repeats them.
        pref = pref | (d << shift)
        # A bucket taken whole needs no lower bits: keys >= its smallest possible key are in.
        lo = tl.where(size == k_rem, 0, shift)
    # After an early stop the bucket is taken whole; `size` then equals k_rem.
    return pref ^ INT32_MIN, k_rem, size


@triton.jit
def _topk_kernel(
    scores_ptr,
    seq_lens_ptr,
    out_ptr,
    C,
    K,
    s_sc_b,
    s_o_b,
    RADIX_BITS: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    PAD_LOADS: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), C)
    n_load = (n + 3) // 4 * 4 if PAD_LOADS else n
    row_ptr = scores_ptr + b.to(tl.int64) * s_sc_b
    out_ptr += b.to(tl.int64) * s_o_b
    thr, take, tied = _radix_threshold(row_ptr, n, n_load, K, RADIX_BITS, ROWS * WIDTH)
    # Splitting ties by position costs a second prefix count; most rows take every tied key.
    if take < tied:
        n_sel = write_selected(row_ptr, out_ptr, 0, n, n_load, thr, take, True, ROWS, WIDTH)
    else:
        n_sel = write_selected(row_ptr, out_ptr, 0, n, n_load, thr, take, False, ROWS, WIDTH)
    pad_tail(out_ptr, 0, K, n_sel, ROWS * WIDTH)


@triton.jit
def _publish(
    hist_ptr,
    above_ptr,
    off_ptr,
    quota_ptr,
    state_ptr,
    b,
    n_seg,
    pref,
    k_rem,
    lo,
    shift,
    s_h_b,
    s_h_s,
    s_v_b,
    NBINS: tl.constexpr,
    S_POW2: tl.constexpr,
):
    """The last program of row b in a pass: sums the segment histograms in segment order, picks
    the bucket, and stores the row state (and, once the threshold is known, the offsets)."""
    sp = tl.arange(0, S_POW2)
    bins = tl.arange(0, NBINS)
    smask = sp < n_seg
    # .cg reads L2, where the other programs' histograms are (L1 is not coherent).
    h2 = tl.load(
        hist_ptr + b * s_h_b + sp[:, None] * s_h_s + bins[None, :],
        mask=smask[:, None],
        other=0,
        cache_modifier=".cg",
    )
    d, above, size = pick_bucket(tl.sum(h2, axis=0), k_rem, NBINS)
    k_rem -= above
    pref = pref | (d << shift)
    # Per segment: keys above the bucket (this pass plus earlier ones) and keys in it.
    gt = tl.sum(tl.where(bins[None, :] > d, h2, 0), axis=1)
    # (The first pass has no earlier count: what the workspace holds then is stale.)
    gt += tl.where(lo < 32, tl.load(above_ptr + b * s_v_b + sp, mask=smask, other=0), 0)
    eq = tl.sum(tl.where(bins[None, :] == d, h2, 0), axis=1)
    done = (size == k_rem) | (shift == 0)
    partial = size > k_rem
    # Ties go to the lowest positions: a segment takes what earlier segments left of k_rem.
    quota = tl.where(partial, tl.minimum(tl.maximum(k_rem - (tl.cumsum(eq, 0) - eq), 0), eq), eq)
    sel = gt + quota
    # A vector compare, not scalar & vector: Triton 3.9's interpreter makes the latter int32.
    done_v = (sp * 0 + done.to(tl.int32)) != 0
    tl.store(off_ptr + b * s_v_b + sp, tl.cumsum(sel, 0) - sel, mask=smask & done_v)
    tl.store(quota_ptr + b * s_v_b + sp, quota, mask=smask & done_v)
    tl.store(above_ptr + b * s_v_b + sp, gt, mask=smask & ~done_v)
    tl.store(state_ptr + b * 4 + _PREF, pref)
    tl.store(state_ptr + b * 4 + _K_REM, k_rem)
    tl.store(state_ptr + b * 4 + _LO, tl.where(done, 0, shift))
    tl.store(state_ptr + b * 4 + _PARTIAL, (done & partial).to(tl.int32))


@triton.jit
def _pass_kernel(
    scores_ptr,
    seq_lens_ptr,
    hist_ptr,
    above_ptr,
    off_ptr,
    quota_ptr,
    state_ptr,
    arrive_ptr,
    C,
    K,
    n_seg,
    s_sc_b,
    s_h_b,
    s_h_s,
    s_v_b,
    FIRST: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    S_POW2: tl.constexpr,
    PAD_LOADS: tl.constexpr,
):
    s = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), C)
    if n > K:
        if FIRST:
            pref = n * 0
            k_rem = n * 0 + K
            lo = n * 0 + 32
        else:
            pref = tl.load(state_ptr + b * 4 + _PREF)
            k_rem = tl.load(state_ptr + b * 4 + _K_REM)
            lo = tl.load(state_ptr + b * 4 + _LO)
        if lo > 0:
            shift = tl.maximum(lo - RADIX_BITS, 0)
            # Loads stop at the segment's end too: the look-ahead chunk of the last step would
            # read the next segment.
            n_load = tl.minimum((n + 3) // 4 * 4 if PAD_LOADS else n, s * SEG + SEG)
            hist = digit_histogram(
                scores_ptr + b.to(tl.int64) * s_sc_b,
                s * SEG,
                tl.minimum(n, s * SEG + SEG),
                n_load,
                pref,
                lo,
                shift,
                1 << RADIX_BITS,
                BLOCK,
            )
            tl.store(hist_ptr + b * s_h_b + s * s_h_s + tl.arange(0, 1 << RADIX_BITS), hist)
            # Every thread's histogram store happens before the release of the arrival.
            tl.debug_barrier()
            if tl.atomic_add(arrive_ptr + b, 1, sem="acq_rel") == n_seg - 1:
                _publish(
                    hist_ptr,
                    above_ptr,
                    off_ptr,
                    quota_ptr,
                    state_ptr,
                    b,
                    n_seg,
                    pref,
                    k_rem,
                    lo,
                    shift,
                    s_h_b,
                    s_h_s,
                    s_v_b,
                    1 << RADIX_BITS,
                    S_POW2,
                )
                tl.atomic_xchg(arrive_ptr + b, 0)


@triton.jit
def _compact_kernel(
    scores_ptr,
    seq_lens_ptr,
    off_ptr,
    quota_ptr,
    state_ptr,
    arrive_ptr,
    out_ptr,
    C,
    K,
    n_seg,
    s_sc_b,
    s_v_b,
    s_o_b,
    SEG: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    PAD_LOADS: tl.constexpr,
):
    s = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), C)
    start = s * SEG
    stop = tl.minimum(n, start + SEG)
    n_load = tl.minimum((n + 3) // 4 * 4 if PAD_LOADS else n, start + SEG)
    row_ptr = scores_ptr + b.to(tl.int64) * s_sc_b
    out_ptr += b.to(tl.int64) * s_o_b
    if n > K:
        thr = tl.load(state_ptr + b * 4 + _PREF) ^ INT32_MIN
        off = tl.load(off_ptr + b * s_v_b + s)
        quota = tl.load(quota_ptr + b * s_v_b + s)
        if tl.load(state_ptr + b * 4 + _PARTIAL) != 0:
            write_selected(
                row_ptr, out_ptr + off, start, stop, n_load, thr, quota, True, ROWS, WIDTH
            )
        else:
            write_selected(
                row_ptr, out_ptr + off, start, stop, n_load, thr, quota, False, ROWS, WIDTH
            )
    else:
        # Every position is selected: segment s starts at output start.
        write_selected(
            row_ptr, out_ptr + start, start, stop, n_load, INT32_MIN, 0, False, ROWS, WIDTH
        )
    pad_chunk = tl.cdiv(K, n_seg)
    pad_tail(
        out_ptr,
        s * pad_chunk,
        tl.minimum(K, s * pad_chunk + pad_chunk),
        tl.minimum(n, K),
        ROWS * WIDTH,
    )
    # The passes leave every counter at 0; resetting here also heals an interrupted call.
    tl.store(arrive_ptr + b, 0, mask=s == 0)


@dataclass(frozen=True)
class TopkWorkspace:
    """Scratch of the segmented schedule, allocated once (CUDA-graph safe), for up to max_batch
    rows of up to max_cols scores: hist [max_batch, S, 2^radix_bits], above, offset, quota
    [max_batch, S] and state [max_batch, 4] int32, arrive [max_batch] int32 (zero between calls),
    with S = ceil(max_cols / segment). segment and radix_bits are fixed here."""

    hist: torch.Tensor
    above: torch.Tensor
    offset: torch.Tensor
    quota: torch.Tensor
    state: torch.Tensor
    arrive: torch.Tensor
    segment: int
    radix_bits: int

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        max_cols: int,
        *,
        segment: int = 4096,
        radix_bits: int = 8,
        device: torch.device | str = "cpu",
    ) -> "TopkWorkspace":
        if segment < 16 or segment % 16 or not 5 <= radix_bits <= 11:
            raise ValueError(
                f"segment must be a multiple of 16 and radix_bits in [5, 11], got "
                f"{segment}, {radix_bits}"
            )
        segs = max(1, triton.cdiv(max_cols, segment))
        # The last program of a pass holds every segment's histogram of its row in registers.
        if triton.next_power_of_2(segs) << radix_bits > 1 << 16:
            raise ValueError(
                f"{segs} segments x 2^{radix_bits} bins is too many: use longer "
                f"segments for {max_cols} columns"
            )

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(
            zeros(max_batch, segs, 1 << radix_bits),
            zeros(max_batch, segs),
            zeros(max_batch, segs),
            zeros(max_batch, segs),
            zeros(max_batch, 4),
            zeros(max_batch),
            segment,
            radix_bits,
        )


def _check(scores: torch.Tensor, seq_lens: torch.Tensor, out_topk: torch.Tensor) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(-1) != 1:
        raise ValueError(
            f"scores: expected [bs, C] fp32 with unit last stride, got "
            f"{tuple(scores.shape)} {scores.dtype}"
        )
    bs = scores.shape[0]
    if seq_lens.shape != (bs,) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens: expected [{bs}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if (
        out_topk.dim() != 2
        or out_topk.shape[0] != bs
        or out_topk.dtype != torch.int32
        or out_topk.stride(-1) != 1
    ):
        raise ValueError(
            f"out_topk: expected [{bs}, k] int32 with unit last stride, got "
            f"{tuple(out_topk.shape)} {out_topk.dtype}"
        )


def _segmented(
    scores,
    seq_lens,
    out,
    ws: TopkWorkspace,
    block: int,
    rows: int,
    width: int,
    num_warps: int,
    pad_loads: bool,
) -> None:
    """Launches the passes and the compaction of the segmented schedule."""
    (bs, cols), k = scores.shape, out.shape[1]
    n_seg = max(1, triton.cdiv(cols, ws.segment))
    if bs > ws.hist.shape[0] or n_seg > ws.hist.shape[1]:
        raise ValueError(
            f"workspace for {ws.hist.shape[0]} rows x {ws.hist.shape[1]} segments "
            f"is too small for {bs} rows x {n_seg} segments"
        )
    grid = (n_seg, bs)
    state = (ws.hist, ws.above, ws.offset, ws.quota, ws.state, ws.arrive)
    # Fixed launch count: ceil(32 / radix_bits) passes; rows already decided return at once.
    for level in range(triton.cdiv(32, ws.radix_bits)):
        _pass_kernel[grid](
            scores,
            seq_lens,
            *state,
            cols,
            k,
            n_seg,
            scores.stride(0),
            ws.hist.stride(0),
            ws.hist.stride(1),
            ws.above.stride(0),
            FIRST=level == 0,
            RADIX_BITS=ws.radix_bits,
            SEG=ws.segment,
            BLOCK=min(block, ws.segment),
            S_POW2=triton.next_power_of_2(n_seg),
            PAD_LOADS=pad_loads,
            num_warps=num_warps,
        )
    _compact_kernel[grid](
        scores,
        seq_lens,
        ws.offset,
        ws.quota,
        ws.state,
        ws.arrive,
        out,
        cols,
        k,
        n_seg,
        scores.stride(0),
        ws.offset.stride(0),
        out.stride(0),
        SEG=ws.segment,
        ROWS=rows,
        WIDTH=width,
        PAD_LOADS=pad_loads,
        num_warps=num_warps,
    )


def topk_select(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    out_topk: torch.Tensor,
    *,
    workspace: TopkWorkspace | None = None,
    radix_bits: int = 6,
    rows: int = 32,
    width: int = 128,
    num_warps: int | None = None,
    block: int = 2048,
) -> None:
    """The k = out_topk.shape[1] highest scores of each row among positions < seq_len.

    scores [bs, C] fp32 (NaN counts as -inf, -0.0 as +0.0), seq_lens [bs] int32 (clamped to
    [0, C]), out_topk [bs, k] int32: the selected positions in ascending order, ties to the lower
    position, padded with -1 when seq_len < k. Allocates nothing and never synchronizes.
    workspace: the segmented schedule (segment and radix_bits come from it; block positions per
    histogram step); without one, one program per row (radix_bits). Both compact in chunks of
    rows * width. num_warps defaults to 16 single, 8 segmented.
    """
    _check(scores, seq_lens, out_topk)
    if (
        not 1 <= radix_bits <= 11
        or min(rows, width) < 16
        or rows & (rows - 1)
        or width & (width - 1)
    ):
        raise ValueError("radix_bits must be in [1, 11]; rows and width powers of two >= 16")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    bs, cols = scores.shape
    if bs == 0 or out_topk.shape[1] == 0:
        return
    # Reading up to 3 positions past seq_len is safe when every row holds a multiple of 4 floats.
    pad_loads = cols % 4 == 0 and scores.stride(0) % 4 == 0
    if workspace is not None:
        _segmented(
            scores, seq_lens, out_topk, workspace, block, rows, width, num_warps or 8, pad_loads
        )
        return
    _topk_kernel[(bs,)](
        scores,
        seq_lens,
        out_topk,
        cols,
        out_topk.shape[1],
        scores.stride(0),
        out_topk.stride(0),
        RADIX_BITS=radix_bits,
        ROWS=rows,
        WIDTH=width,
        PAD_LOADS=pad_loads,
        num_warps=num_warps or 16,
    )
