"""Exact per-row top-k selection: radix select on order-preserving 32-bit keys, then compaction.

Radix select: each pass histograms the next RADIX_BITS bits of the keys that share the prefix
found so far, which tells the bucket holding the k-th largest key. When that bucket is taken
whole, lower bits cannot change the selection and the search stops early. Compaction writes the
selected positions in ascending order; ties at the threshold go to the lowest positions.

Two schedules, same result bit for bit:
- single (no workspace): one program per row does every pass; only bs programs.
- segmented (`TopkWorkspace`; kernels/select/segmented.py): each row is cut into segments of
  `segment` positions, one program per (segment, row). A pass is one launch: every program
  stores its segment's histogram, and the last program of the row to finish (an integer
  arrival counter) sums them in segment order, picks the bucket and stores the row's state;
  once the threshold is known it also stores each segment's output offset. A last launch
  compacts every segment at its offset. All cross-program data are integer counts combined in
  a fixed order, so the output never depends on timing.
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.select.radix import INT32_MIN, digit_histogram, pad_tail, pick_bucket, write_selected
from kernels.select.segmented import launch_segmented
from kernels.select.workspace import TopkWorkspace

__all__ = ["TopkWorkspace", "topk_select"]


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
    _check_tuning(radix_bits, rows, width, block)
    bs, cols = scores.shape
    if bs == 0 or out_topk.shape[1] == 0:
        return
    # Reading up to 3 positions past seq_len is safe when every row holds a multiple of 4 floats.
    pad_loads = cols % 4 == 0 and scores.stride(0) % 4 == 0
    if workspace is not None:
        launch_segmented(
            scores, seq_lens, out_topk, workspace, block, rows, width, num_warps or 8, pad_loads
        )
        return
    _launch_single(scores, seq_lens, out_topk, radix_bits, rows, width, num_warps or 16, pad_loads)


def _launch_single(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    out_topk: torch.Tensor,
    radix_bits: int,
    rows: int,
    width: int,
    num_warps: int,
    pad_loads: bool,
) -> None:
    """One program per row: the whole row's histogram steps and compaction in one program."""
    bs, cols = scores.shape
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
        num_warps=num_warps,
    )


def _check_tuning(radix_bits: int, rows: int, width: int, block: int) -> None:
    """The schedule's sizes the kernels are written for: powers of two, digits of <= 11 bits."""
    if (
        not 1 <= radix_bits <= 11
        or min(rows, width) < 16
        or rows & (rows - 1)
        or width & (width - 1)
    ):
        raise ValueError("radix_bits must be in [1, 11]; rows and width powers of two >= 16")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
