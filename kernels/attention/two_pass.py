"""Sparse MLA decode in two passes that give every head of a request one shared K tile.

The fused kernel (kernels/attention/sparse.py) keeps a [heads, 512] fp32 output accumulator in
registers, so one program holds at most 64 of V3.2's 128 heads: every K tile is gathered (and an
fp8 tile dequantized) twice, and Triton lets both warpgroups of a 64-head tile compute the same
score tile. Split the work where the accumulator stops fitting:

- score pass, one program per (chunk of the slot list, request): all heads (M = 128) against each
  gathered K tile of BLOCK_T rows; per tile it writes p = exp2(s - m_tile) as bf16 with the
  tile's max m_tile (log2 units, rounded up to an integer) and sum l_tile. No output
  accumulator: Q and the scores fit.
- mix pass, one program per (block of BLOCK_D output columns, request): the request's global
  max M from all m_tile first, then out = sum_t (p_t * 2^(m_t - M)) . V_t / L over the tiles in
  slot-list order (2^(m_t - M) is a power of two: exact on the bf16 p), with all heads sharing
  each gathered V tile (only its BLOCK_D columns).

Bits depend on the slot list and BLOCK_T only: chunk length, head block and BLOCK_D change which
program does the work, never a sum's order, so a per-shape launch table changes no output.
fp8 rows dequantize with integer ops (kernels/attention/kv_tiles.py), once per tile for all heads.
HOST_ROWS (with host_off): slot entries <= -2 read host-tier rows in place (host_row_starts).
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.attention.kv_tiles import (
    FAST_SHIFT,
    load_kv_tile,
    load_latent,
    slot_rows,
    tile_scores,
)
from kernels.attention.score_prefetch import score_prefetched
from kernels.attention.tile_softmax import store_tile
from kernels.formats import FP8_BLOCK
from kernels.tiles import exact_dot, staged_slot

# An fp8 row's values per scale: the mix pass reads V in pieces that never straddle two scales.
_FP8_BLOCK = tl.constexpr(FP8_BLOCK)


@triton.jit
def _score_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    host_off,
    row_base_ptr,
    slots_ptr,
    p_ptr,
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
    s_p_b,
    s_p_t,
    s_p_h,
    s_m_b,
    s_m_t,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    STAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    b = tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_nope = tl.load(
        q_nope_ptr + b * s_qn_b + heads[:, None] * s_qn_h + tl.arange(0, D_V)[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + b * s_qp_b + heads[:, None] * s_qp_h + tl.arange(0, D_PE)[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    base = tl.load(row_base_ptr + b).to(tl.int64)
    start = tl.program_id(0) * CHUNK
    stop = tl.minimum(start + CHUNK, K)
    if PREFETCH:
        score_prefetched(
            q_nope, q_pe, kv_ptr, host_off, base, slots_ptr + b * s_sl_b, start, stop, qk_scale,
            p_ptr, pm_ptr, pl_ptr, b, heads, hmask, s_kv, s_p_b, s_p_t, s_p_h, s_m_b, s_m_t,
            D_V, D_PE, BLOCK_T, UPCAST, ROW_FP8, HOST_ROWS,
        )  # fmt: skip
        return
    NB: tl.constexpr = STAGE // BLOCK_T
    for staged in range(start, stop, STAGE):
        offs = staged + tl.arange(0, STAGE)
        ids = tl.reshape(
            tl.load(slots_ptr + b * s_sl_b + offs, mask=offs < stop, other=-1), [NB, BLOCK_T]
        )
        for j in range(0, tl.cdiv(tl.minimum(stop - staged, STAGE), BLOCK_T)):
            slot = staged_slot(ids, j, NB)
            row, valid = slot_rows(slot, base, host_off, s_kv, ROW_FP8, HOST_ROWS)
            k_nope, k_pe = load_kv_tile(
                kv_ptr, row, valid, s_kv, D_V, D_PE, UPCAST, ROW_FP8, HOST_ROWS
            )
            s = tile_scores(q_nope, q_pe, k_nope, k_pe, UPCAST, ROW_FP8)
            store_tile(
                s, valid, qk_scale, p_ptr, pm_ptr, pl_ptr, b, staged // BLOCK_T + j, heads, hmask,
                s_p_b, s_p_t, s_p_h, s_m_b, s_m_t, BLOCK_T,
            )  # fmt: skip


@triton.jit
def _mix_kernel(
    p_ptr,
    pm_ptr,
    pl_ptr,
    kv_ptr,
    host_off,
    row_base_ptr,
    slots_ptr,
    out_ptr,
    lse_ptr,
    H,
    K,
    s_kv,
    s_sl_b,
    s_p_b,
    s_p_t,
    s_p_h,
    s_m_b,
    s_m_t,
    s_o_b,
    s_o_h,
    s_l_b,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NT_POW2: tl.constexpr,
    STAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    b = tl.program_id(1)
    col0 = tl.program_id(0) * BLOCK_D
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    # The request's max over every tile first: each tile's p then needs one factor, 2^(m_t - M).
    tt = tl.arange(0, NT_POW2)
    pm = pm_ptr + b * s_m_b + heads
    tmask = (tt[:, None] < tl.cdiv(K, BLOCK_T)) & hmask[None, :]
    m_all = tl.load(pm[None, :] + tt[:, None] * s_m_t, mask=tmask, other=float("-inf"))
    m_max = tl.max(m_all, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_all = tl.load(pl_ptr + b * s_m_b + heads[None, :] + tt[:, None] * s_m_t, mask=tmask, other=0)
    # L = sum_t l_t * 2^(m_t - M) in the same fixed point: shifts and integer sums are exact.
    shift = tl.minimum(m_use[None, :] - m_all, 63.0).to(tl.int64)
    l_sum = tl.sum(l_all >> shift, axis=0).to(tl.float32) * (1.0 / 1099511627776.0)
    base = tl.load(row_base_ptr + b).to(tl.int64)
    NB: tl.constexpr = STAGE // BLOCK_T
    cols = tl.arange(0, BLOCK_T)
    dv = col0 + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if FLAT:
        # Each tile's slots loaded where used, one flat loop: the pipeliner still copies them
        # (and the V rows they name) ahead asynchronously, and no slot list row goes through
        # shared memory (sm_90 SASS, fp8 256 columns 8 warps 3 stages: 5 barriers a tile
        # instead of 15, no spills instead of 32 B). Same tiles, same order: same bits.
        for t in range(0, tl.cdiv(K, BLOCK_T)):
            offs = t * BLOCK_T + cols
            slot = tl.load(slots_ptr + b * s_sl_b + offs, mask=offs < K, other=-1)
            acc = _mix_tile(
                acc, slot, t, p_ptr, pm, m_use, kv_ptr, host_off, base, b, col0, heads, hmask,
                s_kv, s_p_b, s_p_t, s_p_h, s_m_t, BLOCK_T, BLOCK_D, UPCAST, ROW_FP8, HOST_ROWS,
            )  # fmt: skip
    else:
        for staged in range(0, K, STAGE):
            offs = staged + tl.arange(0, STAGE)
            ids = tl.reshape(
                tl.load(slots_ptr + b * s_sl_b + offs, mask=offs < K, other=-1), [NB, BLOCK_T]
            )
            for j in range(0, tl.cdiv(tl.minimum(K - staged, STAGE), BLOCK_T)):
                acc = _mix_tile(
                    acc, staged_slot(ids, j, NB), staged // BLOCK_T + j, p_ptr, pm, m_use, kv_ptr,
                    host_off, base, b, col0, heads, hmask, s_kv, s_p_b, s_p_t, s_p_h, s_m_t,
                    BLOCK_T, BLOCK_D, UPCAST, ROW_FP8, HOST_ROWS,
                )  # fmt: skip
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    if ROW_FP8 and not UPCAST:
        out = out * (1.0 / FAST_SHIFT)
    tl.store(
        out_ptr + b * s_o_b + heads[:, None] * s_o_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    if col0 == 0:
        lse = (m_max + tl.math.log2(tl.where(empty, 1.0, l_sum))) * 0.6931471805599453
        tl.store(lse_ptr + b * s_l_b + heads, tl.where(empty, float("-inf"), lse), mask=hmask)


@triton.jit
def _mix_tile(
    acc, slot, t, p_ptr, pm, m_use, kv_ptr, host_off, base, b, col0, heads, hmask, s_kv, s_p_b,
    s_p_t, s_p_h, s_m_t, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr, HOST_ROWS: tl.constexpr,
):  # fmt: skip
    """acc + tile t's p (rescaled to the request's max) times its V columns [col0, + BLOCK_D)."""
    row, valid = slot_rows(slot, base, host_off, s_kv, ROW_FP8, HOST_ROWS)
    w = tl.math.exp2(tl.load(pm + t * s_m_t, mask=hmask, other=float("-inf")) - m_use)
    cols = tl.arange(0, BLOCK_T)
    p = tl.load(
        p_ptr + b * s_p_b + t * s_p_t + heads[:, None] * s_p_h + cols[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    p = (p.to(tl.float32) * w[:, None]).to(tl.bfloat16)
    if ROW_FP8:
        W: tl.constexpr = BLOCK_D if BLOCK_D < _FP8_BLOCK else _FP8_BLOCK
        v = load_latent(kv_ptr, row, valid, col0, BLOCK_D // W, W, not UPCAST, HOST_ROWS)
    else:
        dv = col0 + tl.arange(0, BLOCK_D)
        if HOST_ROWS:  # row starts
            v = tl.load(kv_ptr + row[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
        else:
            v = tl.load(kv_ptr + row[:, None] * s_kv + dv[None, :], mask=valid[:, None], other=0.0)
    return exact_dot(p, v, acc, UPCAST)
