"""Split-k of the fused kernel (kernels/attention/fused.py): the slot list cut into the
workspace's fixed number of contiguous ranges; one program per (head block, range, request)
writes a normalized partial (output, running max, sum), and a combine kernel sums the ranges in
ascending order, so the bits depend on k and the split count, never on timing or batch size."""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.attention.fused import _LN2, _attend_range, fused_setup
from kernels.attention.kv_tiles import FAST_SHIFT
from kernels.attention.workspace import AttnWorkspace
from kernels.formats import RowFormat


@triton.jit
def _split_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    host_off,
    row_base_ptr,
    slots_ptr,
    po_ptr,
    pm_ptr,
    pl_ptr,
    qk_scale,
    H,
    K,
    CHUNK,
    s_qn_b,
    s_qn_h,
    s_qp_b,
    s_qp_h,
    s_kv,
    s_sl_b,
    s_po_b,
    s_po_s,
    s_po_h,
    s_pm_b,
    s_pm_s,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):
    # Head blocks vary fastest, so the programs that read the same rows run side by side and the
    # second read of each row comes from L2.
    split = tl.program_id(1)
    b = tl.program_id(2)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    start = split * CHUNK
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
        start,
        tl.minimum(start + CHUNK, K),
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
    # Normalized partials keep a bf16 workspace as accurate as the bf16 output itself.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if ROW_FP8 and not UPCAST:
        out = out * (1.0 / FAST_SHIFT)
    dv = tl.arange(0, D_V)
    tl.store(
        po_ptr + b * s_po_b + split * s_po_s + heads[:, None] * s_po_h + dv[None, :],
        out.to(po_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    tl.store(pm_ptr + b * s_pm_b + split * s_pm_s + heads, m_i, mask=hmask)
    tl.store(pl_ptr + b * s_pm_b + split * s_pm_s + heads, l_i, mask=hmask)


@triton.jit
def _combine_kernel(
    po_ptr,
    pm_ptr,
    pl_ptr,
    out_ptr,
    lse_ptr,
    H,
    S,
    s_po_b,
    s_po_s,
    s_po_h,
    s_pm_b,
    s_pm_s,
    s_o_b,
    s_o_h,
    s_l_b,
    D_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    S_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    sp = tl.arange(0, S_POW2)
    pm = pm_ptr + b * s_pm_b + heads
    m_all = tl.load(
        pm[None, :] + sp[:, None] * s_pm_s,
        mask=(sp[:, None] < S) & hmask[None, :],
        other=float("-inf"),
    )
    m_max = tl.max(m_all, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    dv = tl.arange(0, D_V)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    # Ascending split order: the sum is the same on every call, whatever ran first.
    for split in range(S):
        m_s = tl.load(pm + split * s_pm_s, mask=hmask, other=float("-inf"))
        w = tl.load(pl_ptr + b * s_pm_b + split * s_pm_s + heads, mask=hmask, other=0.0)
        w = w * tl.math.exp2(m_s - m_use)
        o = tl.load(
            po_ptr + b * s_po_b + split * s_po_s + heads[:, None] * s_po_h + dv[None, :],
            mask=hmask[:, None],
            other=0.0,
        )
        acc += w[:, None] * o.to(tl.float32)
        l_sum += w
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    tl.store(
        out_ptr + b * s_o_b + heads[:, None] * s_o_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    lse = (m_max + tl.math.log2(tl.where(empty, 1.0, l_sum))) * _LN2
    tl.store(lse_ptr + b * s_l_b + heads, tl.where(empty, float("-inf"), lse), mask=hmask)


def launch_split(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_base: torch.Tensor,
    slots: torch.Tensor,
    qk_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    row_format: RowFormat,
    workspace: AttnWorkspace,
    *,
    host_off: int | None = None,
    combine_heads: int = 16,
    combine_warps: int = 4,
    **knobs: int,
) -> None:
    """Split-k on checked arguments; host_off as kernels.attention.fused.launch_fused, knobs as
    its fused_setup."""
    bs, n_heads, d_v = q_nope.shape
    splits = workspace.num_splits
    block_h, chunk, strides, meta = fused_setup(q_nope, q_pe, kv, slots, splits, row_format, knobs)
    po, pm, ps = workspace.part_out, workspace.part_max, workspace.part_sum
    _split_kernel[(triton.cdiv(n_heads, block_h), splits, bs)](
        q_nope,
        q_pe,
        kv,
        host_off,
        row_base,
        slots,
        po,
        pm,
        ps,
        qk_scale,
        n_heads,
        slots.shape[1],
        chunk,
        *strides,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pm.stride(0),
        pm.stride(1),
        HOST_ROWS=host_off is not None,
        **meta,
    )
    combine_heads = max(1, min(combine_heads, triton.next_power_of_2(n_heads)))
    _combine_kernel[(bs, triton.cdiv(n_heads, combine_heads))](
        po,
        pm,
        ps,
        out,
        lse,
        n_heads,
        splits,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pm.stride(0),
        pm.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        D_V=d_v,
        BLOCK_H=combine_heads,
        S_POW2=triton.next_power_of_2(splits),
        num_warps=combine_warps,
    )
