"""The segmented schedule of kernels/topk.py's exact top-k (its docstring explains both):
each row is cut into segments of `segment` positions, one program per (segment, row); a pass is
one launch whose last program per row (an integer arrival counter) sums the segments'
histograms in segment order and publishes the row state; a last launch compacts every segment
at its offset. Scratch: `TopkWorkspace`, allocated once."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.radix_select import INT32_MIN, digit_histogram, pad_tail, pick_bucket, write_selected
from kernels.topk_workspace import TopkWorkspace

# Row state in TopkWorkspace.state: unsigned key bits found, rank left, bits left (0 = done),
# and whether only some keys equal to the threshold are taken.
_PREF, _K_REM, _LO, _PARTIAL = (tl.constexpr(i) for i in range(4))


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


def launch_segmented(
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
