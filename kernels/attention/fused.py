"""Fused sparse MLA decode (flash-decoding): one program per (head block, split, request)
walks its range of the slot list with an online softmax and a [heads, 512] fp32 accumulator.

Single pass here; split-k (the slot list cut into a fixed number of ranges, each writing a
normalized partial, and a combine kernel) in kernels/attention/split.py. The two-pass kernels
(kernels/attention/two_pass.py) are the fast decode path; this one serves prefill chunks (no
scratch) and remains the reference point of the benchmark. HOST_ROWS (with host_off): slot entries
<= -2 read host-tier rows in place (kernels/attention/kv_tiles.py, host_row_starts).
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.attention.kv_tiles import FAST_SHIFT, load_kv_tile, slot_rows, tile_scores
from kernels.formats import RowFormat, RowKernel
from kernels.interpreter import INTERPRETED
from kernels.tiles import exact_dot, staged_slot

_LN2 = tl.constexpr(0.6931471805599453)  # log2 -> ln, usable inside kernels


@triton.jit
def _attend_block(
    q_nope,
    q_pe,
    kv_ptr,
    row,
    s_kv,
    valid,
    m_i,
    l_i,
    acc,
    qk_scale,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):
    """One online-softmax step over BLOCK_N gathered rows (host_row_starts); log2 units."""
    # Masked rows are never read, so a padding slot costs no memory traffic.
    k_nope, k_pe = load_kv_tile(kv_ptr, row, valid, s_kv, D_V, D_PE, UPCAST, ROW_FP8, HOST_ROWS)
    s = tile_scores(q_nope, q_pe, k_nope, k_pe, UPCAST, ROW_FP8)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A head that has seen no valid slot yet keeps m = -inf; subtracting 0 avoids inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = exact_dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    host_off,
    row_base_ptr,
    slots_ptr,
    b,
    heads,
    H,
    start,
    stop,
    qk_scale,
    s_qn_b,
    s_qn_h,
    s_qp_b,
    s_qp_h,
    s_kv,
    s_sl_b,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):
    """Online softmax of `heads` of row b over slots [start, stop): (max, log2 units; sum; acc)."""
    hmask = heads[:, None] < H
    dv = tl.arange(0, D_V)
    dp = tl.arange(0, D_PE)
    q_nope = tl.load(
        q_nope_ptr + b * s_qn_b + heads[:, None] * s_qn_h + dv[None, :], mask=hmask, other=0.0
    )
    q_pe = tl.load(
        q_pe_ptr + b * s_qp_b + heads[:, None] * s_qp_h + dp[None, :], mask=hmask, other=0.0
    )
    base = tl.load(row_base_ptr + b).to(tl.int64)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    NB: tl.constexpr = STAGE // BLOCK_N
    for staged in range(start, stop, STAGE):
        # STAGE slots sit in registers (see staged_slot).
        offs = staged + tl.arange(0, STAGE)
        ids = tl.load(slots_ptr + b * s_sl_b + offs, mask=offs < stop, other=-1)
        ids = tl.reshape(ids, [NB, BLOCK_N])
        for j in range(0, tl.cdiv(tl.minimum(stop - staged, STAGE), BLOCK_N)):
            slot = staged_slot(ids, j, NB)
            row, valid = slot_rows(slot, base, host_off, s_kv, ROW_FP8, HOST_ROWS)
            m_i, l_i, acc = _attend_block(
                q_nope,
                q_pe,
                kv_ptr,
                row,
                s_kv,
                valid,
                m_i,
                l_i,
                acc,
                qk_scale,
                D_V,
                D_PE,
                UPCAST,
                ROW_FP8,
                HOST_ROWS,
            )
    return m_i, l_i, acc


@triton.jit
def _fused_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    host_off,
    row_base_ptr,
    slots_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    H,
    K,
    s_qn_b,
    s_qn_h,
    s_qp_b,
    s_qp_h,
    s_kv,
    s_sl_b,
    s_o_b,
    s_o_h,
    s_l_b,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):
    b = tl.program_id(1)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    m_i, l_i, acc = _attend_range(
        q_nope_ptr,
        q_pe_ptr,
        kv_ptr,
        host_off,
        row_base_ptr,
        slots_ptr,
        b,
        heads,
        H,
        0,
        K,
        qk_scale,
        s_qn_b,
        s_qn_h,
        s_qp_b,
        s_qp_h,
        s_kv,
        s_sl_b,
        D_V,
        D_PE,
        BLOCK_H,
        BLOCK_N,
        STAGE,
        UPCAST,
        ROW_FP8,
        HOST_ROWS,
    )
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if ROW_FP8 and not UPCAST:
        out = out * (1.0 / FAST_SHIFT)
    dv = tl.arange(0, D_V)
    tl.store(
        out_ptr + b * s_o_b + heads[:, None] * s_o_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * _LN2
    tl.store(lse_ptr + b * s_l_b + heads, tl.where(empty, float("-inf"), lse), mask=hmask)


def fused_setup(q_nope, q_pe, kv, slots, splits: int, row_format: RowFormat, knobs: dict) -> tuple:
    """(block_h, chunk, strides, meta) of a fused launch; knobs: block_h, block_n, num_stages,
    num_warps, slot_stage (block_n rows per step, num_stages - 1 steps of rows in flight,
    slot_stage slots held in registers per refill). Shared memory ~ (block_h + block_n *
    num_stages) * 1152 B: the default 64 x 64 x 2 is the fastest fused bf16 setting measured
    (docs/BENCHMARKS.md) and fits. meta leaves HOST_ROWS to the launch, beside its host_off."""
    bs, n_heads, d_v = q_nope.shape
    k = slots.shape[1]
    # tl.dot wants tiles of at least 16 rows; padding heads are masked.
    block_h = max(16, min(knobs.get("block_h", 64), triton.next_power_of_2(n_heads)))
    # A short slot list needs no longer block (fewer padding columns; the same sums).
    block_n = max(16, min(knobs.get("block_n", 64), triton.next_power_of_2(k)))
    # Whole blocks per split: the ranges, hence the sums, depend only on k, S and block_n.
    chunk = triton.cdiv(triton.cdiv(k, splits), block_n) * block_n
    slot_stage = triton.next_power_of_2(knobs.get("slot_stage", 512))
    strides = (
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv.stride(0),
        slots.stride(0),
    )
    meta = dict(
        D_V=d_v,
        D_PE=q_pe.shape[-1],
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        STAGE=max(block_n, min(slot_stage, triton.next_power_of_2(chunk))),
        UPCAST=INTERPRETED,
        ROW_FP8=row_format.kernel is RowKernel.FP8,
        num_warps=knobs.get("num_warps", 8),
        num_stages=knobs.get("num_stages", 2),
    )
    return block_h, chunk, strides, meta


def launch_fused(
    q_nope,
    q_pe,
    kv,
    row_base,
    slots,
    qk_scale,
    out,
    lse,
    row_format: RowFormat,
    host_off: int | None = None,
    **knobs: int,
) -> None:
    """The single-pass fused kernel on checked arguments (sparse_attention.sparse_mla_decode);
    host_off: the host tier's checked offset from kv in kv elements, None without one."""
    bs, n_heads, _ = q_nope.shape
    block_h, _, strides, meta = fused_setup(q_nope, q_pe, kv, slots, 1, row_format, knobs)
    _fused_kernel[(triton.cdiv(n_heads, block_h), bs)](
        q_nope,
        q_pe,
        kv,
        host_off,
        row_base,
        slots,
        out,
        lse,
        qk_scale,
        n_heads,
        slots.shape[1],
        *strides,
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        HOST_ROWS=host_off is not None,
        **meta,
    )
