"""A plan program's request and entries, read the same way by the swap plan's kernel
(kernels/swap/plan.py) and the shared phase's lookup (kernels/swap/shared_table.py)."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl


@triton.jit
def group_entries(
    b, topk_ptr, seq_lens_ptr, req_slots_ptr, req_mode_ptr, k, R, C, G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program b's request slot r (its first row's; -1 or out of range: padding, mode 0), its
    mode, and its entries: its G rows of k positions, contiguous (entry i, position t, the
    length of its row, clamped to [0, C])."""
    r = tl.load(req_slots_ptr + b * G)
    r_ok = (r >= 0) & (r < R)
    mode = tl.load(req_mode_ptr + r, mask=r_ok, other=0)
    i = tl.arange(0, BLOCK_K)
    in_k = i < G * k
    t = tl.load(topk_ptr + b.to(tl.int64) * G * k + i, mask=in_k, other=-1)
    row_len = tl.load(seq_lens_ptr + b * G + i // k, mask=in_k, other=0)
    row_len = tl.minimum(tl.maximum(row_len, 0), C)
    return r, r_ok, mode, i, in_k, t, row_len
