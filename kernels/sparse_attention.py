"""Absorbed MLA decode attention over a per-row list of KV slots (DeepSeek-V3.2 sparse attention).

One program owns (batch row, block of heads) and walks the slot list in fixed blocks of BLOCK_N,
so the summation order depends only on the slot list: two KV layouts that gather the same rows in
the same order give bitwise-identical output. No split-k, no atomics.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Read once: kernels/__init__.py sets TRITON_INTERPRET before this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_LOG2E = 1.4426950408889634


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
def _attend_block(q_nope, q_pe, row_ptr, valid, m_i, l_i, acc, qk_scale,
                  D_V: tl.constexpr, D_PE: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over BLOCK_N gathered rows; scores are in log2 units."""
    dv = tl.arange(0, D_V)
    dp = tl.arange(0, D_PE)
    # Masked rows are never read, so a padding slot costs no memory traffic.
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
def _sparse_mla_decode_kernel(
        q_nope_ptr, q_pe_ptr, kv_ptr, row_base_ptr, slots_ptr, out_ptr, lse_ptr,
        qk_scale, H, K,
        s_qn_b, s_qn_h, s_qp_b, s_qp_h, s_kv, s_sl_b, s_o_b, s_o_h, s_l_b,
        D_V: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr):
    b = tl.program_id(1)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dv = tl.arange(0, D_V)
    dp = tl.arange(0, D_PE)
    q_nope = tl.load(q_nope_ptr + b * s_qn_b + heads[:, None] * s_qn_h + dv[None, :],
                     mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + b * s_qp_b + heads[:, None] * s_qp_h + dp[None, :],
                   mask=hmask[:, None], other=0.0)
    base = tl.load(row_base_ptr + b).to(tl.int64)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for start in range(0, K, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + b * s_sl_b + offs, mask=offs < K, other=-1)
        row_ptr = kv_ptr + (base + slot.to(tl.int64)) * s_kv
        m_i, l_i, acc = _attend_block(q_nope, q_pe, row_ptr, slot >= 0, m_i, l_i, acc, qk_scale,
                                      D_V, D_PE, UPCAST)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(out_ptr + b * s_o_b + heads[:, None] * s_o_h + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453  # log2 -> ln
    tl.store(lse_ptr + b * s_l_b + heads, tl.where(empty, float("-inf"), lse), mask=hmask)


def _check_rowmajor(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected {ndim}-d {dtype} with unit last stride, "
                         f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}")


def sparse_mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                      row_base: torch.Tensor, slots: torch.Tensor, scale: float,
                      out: torch.Tensor, lse: torch.Tensor, *, block_h: int = 64,
                      block_n: int = 64, num_warps: int = 8, num_stages: int = 2) -> None:
    """Absorbed MLA decode over the KV rows `row_base[b] + slots[b, i]`; slots < 0 are skipped.

    q_nope [bs, H, 512] bf16, q_pe [bs, H, 64] bf16, kv [n_rows, 576] bf16 (latent then rope key),
    row_base [bs] int64, slots [bs, k] int32, out [bs, H, 512] bf16, lse [bs, H] fp32.
    score_i = scale * (q_nope . kv[row, :512] + q_pe . kv[row, 512:]); out = softmax . kv[row, :512];
    lse = natural-log log-sum-exp of the scores. A row with no valid slot gets out = 0, lse = -inf.
    Allocates nothing and never synchronizes. The defaults target Hopper: 64 heads x 64 rows per
    step use ~216 KB of shared memory; block_n=32, num_stages=3 needs ~145 KB.
    """
    bs, n_heads, d_v = q_nope.shape
    d_pe = q_pe.shape[-1]
    _check_rowmajor("q_nope", q_nope, torch.bfloat16, 3)
    _check_rowmajor("q_pe", q_pe, torch.bfloat16, 3)
    _check_rowmajor("kv", kv, torch.bfloat16, 2)
    _check_rowmajor("slots", slots, torch.int32, 2)
    _check_rowmajor("out", out, torch.bfloat16, 3)
    _check_rowmajor("lse", lse, torch.float32, 2)
    if (tuple(q_pe.shape[:2]) != (bs, n_heads) or kv.shape[1] != d_v + d_pe
            or slots.shape[0] != bs or tuple(out.shape) != (bs, n_heads, d_v)
            or tuple(lse.shape) != (bs, n_heads)):
        raise ValueError("shape mismatch between q_nope, q_pe, kv, slots, out and lse")
    if d_v & (d_v - 1) or d_pe & (d_pe - 1):
        raise ValueError(f"latent and rope widths must be powers of two, got {d_v} and {d_pe}")
    if row_base.shape != (bs,) or row_base.dtype != torch.int64:
        raise ValueError(f"row_base: expected [{bs}] int64, got {tuple(row_base.shape)} {row_base.dtype}")
    if bs == 0:
        return
    # tl.dot wants tiles of at least 16 rows; padding heads are masked.
    block_h = max(16, min(block_h, triton.next_power_of_2(n_heads)))
    grid = (triton.cdiv(n_heads, block_h), bs)
    _sparse_mla_decode_kernel[grid](
        q_nope, q_pe, kv, row_base, slots, out, lse,
        scale * _LOG2E, n_heads, slots.shape[1],
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
        slots.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        D_V=d_v, D_PE=d_pe, BLOCK_H=block_h, BLOCK_N=block_n, UPCAST=INTERPRETED,
        num_warps=num_warps, num_stages=num_stages)
