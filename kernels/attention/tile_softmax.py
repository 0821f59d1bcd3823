"""A score tile's softmax partials, as the two-pass decode's score pass stores them for its mix
pass (kernels/attention/two_pass.py has the scheme): p = exp2(s - m) as bf16, the tile max m as an
integer in log2 units, and the sum of p in 2^-40 fixed point."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl


@triton.jit
def store_tile(
    s,
    valid,
    qk_scale,
    p_ptr,
    pm_ptr,
    pl_ptr,
    b,
    t,
    heads,
    hmask,
    s_p_b,
    s_p_t,
    s_p_h,
    s_m_b,
    s_m_t,
    BLOCK_T: tl.constexpr,
):
    """Tile t's probabilities, max and sum from its raw scores s [heads, BLOCK_T]."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    # An integer max (log2 units): the mix pass's factor 2^(m - M) is then a power of two, and
    # rescaling the bf16 p by it rounds nothing (p is rounded once, as in the fused kernel).
    # ceil keeps p <= 1; an empty tile keeps m = -inf.
    m = tl.ceil(tl.max(s, axis=1))
    p = tl.math.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    tl.store(
        p_ptr + b * s_p_b + t * s_p_t + heads[:, None] * s_p_h + tl.arange(0, BLOCK_T)[None, :],
        p.to(tl.bfloat16),
        mask=hmask[:, None],
    )
    tl.store(pm_ptr + b * s_m_b + t * s_m_t + heads, m, mask=hmask)
    # The sum in 2^-40 fixed point (int64): integer sums are exact, so their order, which
    # follows the launch's layout, cannot change a bit.
    l_fix = tl.sum((p * 1099511627776.0).to(tl.int64), axis=1)
    tl.store(pl_ptr + b * s_m_b + t * s_m_t + heads, l_fix, mask=hmask)
