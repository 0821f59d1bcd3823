"""The two-pass decode's score loop with a register prefetch (LaunchConfig.score_prefetch): tile
t + 1's gathers are issued before tile t is dequantized and multiplied. With one program an SM
(Q and one K tile fill its shared memory, kernels/attention/two_pass.py) no other program hides
a gather's latency, and the pipeliner cannot (the bytes go through registers to be dequantized).
Each tile's slots are loaded in the layout that uses them: the plain loop's staged slot list
reaches each tile through shared memory (27 barriers a tile in the fp8 sm_90 SASS, 12 here).
Same tiles, same arithmetic: the same bits as the plain loop."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.attention.kv_tiles import kv_tile_of, load_kv_bytes, slot_rows, tile_scores
from kernels.attention.tile_softmax import store_tile


@triton.jit
def score_prefetched(
    q_nope, q_pe, kv_ptr, host_off, base, slot_ptr, start, stop, qk_scale, p_ptr, pm_ptr,
    pl_ptr, b, heads, hmask, s_kv, s_p_b, s_p_t, s_p_h, s_m_b, s_m_t, D_V: tl.constexpr,
    D_PE: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr, ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):  # fmt: skip
    """The score loop with tile t + 1's gathers issued before tile t's dequantization and dots
    (with one program an SM, Q and a K tile filling its shared memory, nothing else hides them),
    and each tile's slots loaded where they are used (no exchange through shared memory)."""
    valid, lat, sc, pe = _tile_bytes(
        kv_ptr, host_off, base, slot_ptr, start, stop, s_kv, D_V, D_PE, BLOCK_T, ROW_FP8, HOST_ROWS
    )
    for t0 in range(start, stop, BLOCK_T):
        valid_t, lat_t, sc_t, pe_t = valid, lat, sc, pe
        valid, lat, sc, pe = _tile_bytes(
            kv_ptr, host_off, base, slot_ptr, t0 + BLOCK_T, stop, s_kv, D_V, D_PE, BLOCK_T,
            ROW_FP8, HOST_ROWS,
        )  # fmt: skip
        k_nope, k_pe = kv_tile_of(lat_t, sc_t, pe_t, UPCAST, ROW_FP8)
        s = tile_scores(q_nope, q_pe, k_nope, k_pe, UPCAST, ROW_FP8)
        store_tile(
            s, valid_t, qk_scale, p_ptr, pm_ptr, pl_ptr, b, t0 // BLOCK_T, heads, hmask, s_p_b,
            s_p_t, s_p_h, s_m_b, s_m_t, BLOCK_T,
        )  # fmt: skip


@triton.jit
def _tile_bytes(
    kv_ptr,
    host_off,
    base,
    slot_ptr,
    t0,
    stop,
    s_kv,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):
    """(valid, tile bytes) of the tile of slots [t0, t0 + BLOCK_T) below stop (none past it)."""
    offs = t0 + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + offs, mask=offs < stop, other=-1)
    row, valid = slot_rows(slot, base, host_off, s_kv, ROW_FP8, HOST_ROWS)
    lat, sc, pe = load_kv_bytes(kv_ptr, row, valid, s_kv, D_V, D_PE, ROW_FP8, HOST_ROWS)
    return valid, lat, sc, pe
