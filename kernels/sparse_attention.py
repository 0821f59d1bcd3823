"""Absorbed MLA decode attention over a per-row list of KV slots (DeepSeek-V3.2 sparse attention).

Single pass: one program owns (block of heads, batch row) and walks the slot list in fixed blocks
of BLOCK_N. Split-k (with an `AttnWorkspace`): the slot list is cut into the workspace's fixed
number of contiguous ranges; one program per (head block, range, batch row) writes a partial
(normalized output, running max, sum) to the workspace, and a second kernel combines the ranges
in ascending order. Either way the summation order depends only on the slot list and the split
count, never on timing or batch size: no atomics, and two KV layouts that gather the same rows in
the same order give bitwise-identical output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.formats import BF16_ROW, LATENT_DIM, ROPE_DIM, RowFormat, RowKernel
from kernels.fp8_row import load_fp8_block
from kernels.interpreter import INTERPRETED

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)  # log2 -> ln, usable inside kernels


@triton.jit
def bf16_dot(a, b, acc, UPCAST: tl.constexpr):
    """tl.dot of bf16 (or fp8) tiles with fp32 accumulation; UPCAST under the interpreter."""
    if UPCAST:
        # Triton 3.9's interpreter multiplies the raw bits of bf16 operands; fp32 products of
        # bf16 values are exact, so upcasting keeps the GPU's numerics.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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
):
    """One online-softmax step over BLOCK_N gathered rows; scores are in log2 units."""
    # Masked rows are never read, so a padding slot costs no memory traffic.
    if ROW_FP8:
        # Dequantized in registers: exact bf16 values, then the same math as bf16 rows.
        k_nope, k_pe = load_fp8_block(kv_ptr, row, valid, D_V, D_PE, UPCAST)
    else:
        dv = tl.arange(0, D_V)
        dp = tl.arange(0, D_PE)
        row_ptr = kv_ptr + row * s_kv
        k_nope = tl.load(row_ptr[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
        k_pe = tl.load(row_ptr[:, None] + D_V + dp[None, :], mask=valid[:, None], other=0.0)
    s = bf16_dot(q_pe, tl.trans(k_pe), bf16_dot(q_nope, tl.trans(k_nope), None, UPCAST), UPCAST)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A head that has seen no valid slot yet keeps m = -inf; subtracting 0 avoids inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = bf16_dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
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
        # STAGE slots sit in registers, so the KV loads of the inner loop have addresses that
        # come from no load of that loop: Triton's pipeliner then keeps num_stages - 1 blocks
        # in flight (with a slot load in the loop it keeps one, and waits for it every step).
        offs = staged + tl.arange(0, STAGE)
        ids = tl.load(slots_ptr + b * s_sl_b + offs, mask=offs < stop, other=-1)
        ids = tl.reshape(ids, [NB, BLOCK_N])
        for j in range(0, tl.cdiv(tl.minimum(stop - staged, STAGE), BLOCK_N)):
            slot = tl.sum(tl.where(tl.arange(0, NB)[:, None] == j, ids, 0), axis=0)
            m_i, l_i, acc = _attend_block(
                q_nope,
                q_pe,
                kv_ptr,
                base + slot.to(tl.int64),
                s_kv,
                slot >= 0,
                m_i,
                l_i,
                acc,
                qk_scale,
                D_V,
                D_PE,
                UPCAST,
                ROW_FP8,
            )
    return m_i, l_i, acc


@triton.jit
def _sparse_mla_decode_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
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
):
    b = tl.program_id(1)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    m_i, l_i, acc = _attend_range(
        q_nope_ptr,
        q_pe_ptr,
        kv_ptr,
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
    )
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    dv = tl.arange(0, D_V)
    tl.store(
        out_ptr + b * s_o_b + heads[:, None] * s_o_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * _LN2
    tl.store(lse_ptr + b * s_l_b + heads, tl.where(empty, float("-inf"), lse), mask=hmask)


@triton.jit
def _split_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
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
    )
    # Normalized partials keep a bf16 workspace as accurate as the bf16 output itself.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
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


@dataclass(frozen=True)
class AttnWorkspace:
    """Split-k scratch of sparse_mla_decode, allocated once (CUDA-graph safe): normalized partial
    outputs part_out [max_bs, S, H, D_V] (fp32, or bf16 for half the traffic), running maxima
    (log2 units) part_max and sums part_sum [max_bs, S, H] fp32. S, the split count, is fixed
    here, never by the batch: a row's output bits do not depend on its batch mates."""

    part_out: torch.Tensor
    part_max: torch.Tensor
    part_sum: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.part_out.shape[1]

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        num_splits: int,
        *,
        d_v: int = 512,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "AttnWorkspace":
        if num_splits < 1 or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"need num_splits >= 1 and an fp32/bf16 workspace, got {num_splits} {dtype}"
            )
        shape = (max_batch, num_splits, num_heads)
        return cls(
            torch.empty(shape + (d_v,), dtype=dtype, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )


def decode_num_splits(topk: int) -> int:
    """Split count for decode workspaces: a function of k alone (batch-invariant bits), about one
    split per 1024 slots, at most 8."""
    return max(1, min(8, topk // 1024))


def _check_rowmajor(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim or t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected {ndim}-d {dtype} with unit last stride, "
            f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_args(q_nope, q_pe, kv, row_base, slots, out, lse, row_format: RowFormat) -> None:
    bs, n_heads, d_v = q_nope.shape
    d_pe = q_pe.shape[-1]
    _check_rowmajor("q_nope", q_nope, torch.bfloat16, 3)
    _check_rowmajor("q_pe", q_pe, torch.bfloat16, 3)
    if row_format.kernel is None:
        raise ValueError(f"row format {row_format.name} has no Triton kernel: use the references")
    if row_format.kernel is RowKernel.FP8:
        # fp8 rows: the kernel hard-codes the byte layout of a 512 + 64 row (kernels.fp8_row).
        width = row_format.row_bytes
        if (
            kv.dtype != torch.uint8
            or kv.dim() != 2
            or kv.shape[1] != width
            or kv.stride() != (width, 1)
            or (d_v, d_pe) != (LATENT_DIM, ROPE_DIM)
        ):
            raise ValueError(
                f"kv: fp8 rows must be contiguous [n, {width}] uint8 with "
                f"{LATENT_DIM} + {ROPE_DIM} values, got {tuple(kv.shape)} strides {kv.stride()}"
            )
    else:
        _check_rowmajor("kv", kv, torch.bfloat16, 2)
    _check_rowmajor("slots", slots, torch.int32, 2)
    _check_rowmajor("out", out, torch.bfloat16, 3)
    _check_rowmajor("lse", lse, torch.float32, 2)
    if (
        tuple(q_pe.shape[:2]) != (bs, n_heads)
        or (row_format.kernel is RowKernel.BF16 and kv.shape[1] != d_v + d_pe)
        or slots.shape[0] != bs
        or tuple(out.shape) != (bs, n_heads, d_v)
        or tuple(lse.shape) != (bs, n_heads)
    ):
        raise ValueError("shape mismatch between q_nope, q_pe, kv, slots, out and lse")
    if d_v & (d_v - 1) or d_pe & (d_pe - 1):
        raise ValueError(f"latent and rope widths must be powers of two, got {d_v} and {d_pe}")
    if row_base.shape != (bs,) or row_base.dtype != torch.int64:
        raise ValueError(
            f"row_base: expected [{bs}] int64, got {tuple(row_base.shape)} {row_base.dtype}"
        )


def _check_workspace(ws: AttnWorkspace, bs: int, n_heads: int, d_v: int) -> None:
    cap, splits, heads, width = ws.part_out.shape
    if (
        cap < bs
        or heads != n_heads
        or width != d_v
        or not ws.part_out.is_contiguous()
        or tuple(ws.part_max.shape) != (cap, splits, heads)
        or not ws.part_max.is_contiguous()
        or ws.part_sum.shape != ws.part_max.shape
        or not ws.part_sum.is_contiguous()
    ):
        raise ValueError(
            f"workspace {tuple(ws.part_out.shape)} does not fit batch {bs}, "
            f"{n_heads} heads of width {d_v}"
        )


def sparse_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_base: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    row_format: RowFormat = BF16_ROW,
    workspace: AttnWorkspace | None = None,
    block_h: int = 64,
    block_n: int = 32,
    num_stages: int = 3,
    num_warps: int = 8,
    slot_stage: int = 512,
    combine_heads: int = 16,
    combine_warps: int = 4,
) -> None:
    """Absorbed MLA decode over the KV rows `row_base[b] + slots[b, i]`; slots < 0 are skipped.

    q_nope [bs, H, 512] bf16, q_pe [bs, H, 64] bf16, kv the rows as `row_format` has attention
    read them: bf16 [n_rows, 576] (latent then rope key), or DeepSeek-V3.2 fp8 rows uint8
    (kernels.fp8_row) dequantized in registers,
    row_base [bs] int64, slots [bs, k] int32, out [bs, H, 512] bf16, lse [bs, H] fp32.
    score_i = scale * (q_nope . kv[row, :512] + q_pe . kv[row, 512:]);
    out = softmax . kv[row, :512];
    lse = natural-log log-sum-exp of the scores. A row with no valid slot gets out = 0, lse = -inf.
    workspace: split-k scratch, used when workspace.num_splits > 1 (more programs for small
    batches); without one, a single pass. Allocates nothing and never synchronizes.
    Tunables: block_n rows per step, num_stages - 1 steps of rows in flight, slot_stage slots held
    in registers per refill of the pipeline. Shared memory ~ (block_h + block_n * num_stages) *
    1152 B: 64 x 32 x 3 ~185 KB, 64 x 32 x 4 or 64 x 64 x 2 ~220 KB (Hopper allows 227 KB).
    """
    _check_args(q_nope, q_pe, kv, row_base, slots, out, lse, row_format)
    bs, n_heads, d_v = q_nope.shape
    k = slots.shape[1]
    if bs == 0:
        return
    # tl.dot wants tiles of at least 16 rows; padding heads are masked.
    block_h = max(16, min(block_h, triton.next_power_of_2(n_heads)))
    splits = 1 if workspace is None else workspace.num_splits
    # Whole blocks per split: the ranges, hence the sums, depend only on k, S and block_n.
    chunk = triton.cdiv(triton.cdiv(k, splits), block_n) * block_n
    stage = max(block_n, min(triton.next_power_of_2(slot_stage), triton.next_power_of_2(chunk)))
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
        STAGE=stage,
        UPCAST=INTERPRETED,
        ROW_FP8=row_format.kernel is RowKernel.FP8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits == 1:
        _sparse_mla_decode_kernel[(triton.cdiv(n_heads, block_h), bs)](
            q_nope,
            q_pe,
            kv,
            row_base,
            slots,
            out,
            lse,
            scale * _LOG2E,
            n_heads,
            k,
            *strides,
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            **meta,
        )
        return
    _check_workspace(workspace, bs, n_heads, d_v)
    po, pm, ps = workspace.part_out, workspace.part_max, workspace.part_sum
    _split_kernel[(triton.cdiv(n_heads, block_h), splits, bs)](
        q_nope,
        q_pe,
        kv,
        row_base,
        slots,
        po,
        pm,
        ps,
        scale * _LOG2E,
        n_heads,
        k,
        chunk,
        *strides,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pm.stride(0),
        pm.stride(1),
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
