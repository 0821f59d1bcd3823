"""Miss copy: move the rows a swap plan missed from the host tier into the hot buffers.

On GPU the host tier is a `kernels.uva.UVATensor`: the kernel loads the pinned host rows directly
over PCIe, so the miss list never round-trips through the CPU.

Grid: a persistent grid walks one flat work list, the concatenation of every request's miss
list. Counts are only known on the device (the plan kernel writes them in the same graph), so
every CTA sums them itself, and from the total derives how many CTAs work (`CopyGrid`: the copy
beside compute takes no more SMs than its bytes need; the rest exit at once). Each working CTA
takes one contiguous range of whole chunks of ROWS rows, finds the request holding its first row
with one scan of the counts, then walks the requests forward: per chunk no search at all (the
version before compared every chunk's rows with all bs running sums, an [ROWS, bs] tile per
chunk). A chunk never spans two requests, so a request's short tail leaves lanes idle, not
memory traffic. A grid of one program per (request, miss chunk) would launch bs * k / ROWS
mostly empty programs (32,768 at bs 128, ~23 us with no miss at all).

Rows are moved as int32 words; the row width is a compile-time constant so the compiler can prove
16-byte alignment and emit 128-bit loads and stores for both row formats (1152 B = 72 x 16 B,
656 B = 41 x 16 B). Masked lanes of the power-of-two tile issue no memory traffic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Union

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.swap.copy_checks import check_copy, check_landing
from kernels.swap.copy_grid import CopyGrid
from kernels.uva import UVATensor

# Programs per SM of the default persistent grid (the in-stream copy, alone on the GPU).
PROGRAMS_PER_SM = 8
# Requests scanned per vector step of the counts.
BATCH_BLOCK = 256
CPU_PROGRAMS = 4
# Every launched CTA works: the grid of the in-stream copy, which has the GPU to itself.
ALL_PROGRAMS = CopyGrid()


@triton.jit
def _total_rows(count_ptr, bs, k, BS_BLOCK: tl.constexpr):
    """Rows of the flat work list: the counts clamped to [0, k], summed."""
    total = 0
    for blk in range(0, bs, BS_BLOCK):
        r = blk + tl.arange(0, BS_BLOCK)
        c = tl.load(count_ptr + r, mask=r < bs, other=0)
        total += tl.sum(tl.minimum(tl.maximum(c, 0), k), 0)
    return total


@triton.jit
def _request_of(count_ptr, row, bs, k, BS_BLOCK: tl.constexpr):
    """The request whose list holds flat work-list row `row`, and the flat row its list starts
    at: one scan of the counts per CTA, not one per chunk."""
    b = 0
    start = 0
    off = 0
    for blk in range(0, bs, BS_BLOCK):
        r = blk + tl.arange(0, BS_BLOCK)
        c = tl.minimum(tl.maximum(tl.load(count_ptr + r, mask=r < bs, other=0), 0), k)
        # The running ends are ascending, so the requests ending at or before `row` are a prefix.
        before = off + tl.cumsum(c, 0) <= row
        b += tl.sum(before.to(tl.int32), 0)
        start += tl.sum(tl.where(before, c, 0), 0)
        off += tl.sum(c, 0)
    return b, start


@triton.jit
def _row_numbers(src_row, dst_row, u, n, VPR):
    """Source and destination rows of vectors u (< n; -1 past n) of one request's miss list.
    The vectors of one warp lie in one or two rows: its loads hit one or two addresses."""
    live = u < n
    src = tl.load(src_row + u // VPR, mask=live, other=-1)
    dst = tl.load(dst_row + u // VPR, mask=live, other=-1)
    return src, dst


@triton.jit
def _copy_vectors(
    host_ptr, hot_ptr, src, dst, u, host_rows, hot_rows, VW, VPR, land_ptr, f0, land_rows, LANDING
):
    """Vectors u of rows src -> dst (VPR vectors of VW words per row; -1: none). LANDING: the
    flat work rows f0 + u // VPR below land_rows come from land_ptr's row f instead (the staged
    copy put them on the device already)."""
    # A row outside either tier is a caller bug: skip it rather than touch foreign memory.
    ok = (src >= 0) & (src < host_rows) & (dst >= 0) & (dst < hot_rows)
    col = (u % VPR) * VW
    q = tl.arange(0, VW)[None, :]
    mask = ok[:, None] & (q < VW)
    if LANDING:
        f = f0 + u // VPR
        landed = (f < land_rows)[:, None]
        far = tl.load(host_ptr + (src * (VPR * VW) + col)[:, None] + q, mask=mask & ~landed)
        near = tl.load(land_ptr + (f * (VPR * VW) + col)[:, None] + q, mask=mask & landed)
        words = tl.where(landed, near, far)
    else:
        words = tl.load(host_ptr + (src * (VPR * VW) + col)[:, None] + q, mask=mask)
    tl.store(hot_ptr + (dst * (VPR * VW) + col)[:, None] + q, words, mask=mask)


@triton.jit(do_not_specialize=["rows_per_active", "min_active"])
def _miss_copy_kernel(
    host_ptr,
    hot_ptr,
    src_ptr,
    dst_ptr,
    count_ptr,
    bs,
    k,
    host_rows,
    hot_rows,
    rows_per_active,
    min_active,
    land_ptr,
    land_rows,
    VW: tl.constexpr,
    VPR: tl.constexpr,
    VECTORS: tl.constexpr,
    BS_BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr,
    LANDING: tl.constexpr,
):
    host_ptr = host_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    hot_ptr = hot_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    land_ptr = land_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    total = _total_rows(count_ptr, bs, k, BS_BLOCK)
    # The working CTAs (CopyGrid.active): the rest of the launched grid exits here.
    active = tl.num_programs(0)
    if rows_per_active > 0:
        active = tl.maximum(
            tl.minimum(min_active, active), tl.minimum(tl.cdiv(total, rows_per_active), active)
        )
    # Each working CTA copies one contiguous range of the flat work list: it finds its first
    # request once, then walks the requests forward, VECTORS vectors per iteration.
    per = tl.cdiv(total, active)
    lo = tl.minimum(tl.minimum(tl.program_id(0), active) * per, total)
    hi = tl.minimum(lo + per, total)
    if lo < hi:
        b, start = _request_of(count_ptr, lo, bs, k, BS_BLOCK)
        i = lo
        while i < hi:
            c = tl.minimum(tl.maximum(tl.load(count_ptr + b), 0), k)
            end = tl.minimum(start + c, hi)
            src_row = src_ptr + b.to(tl.int64) * k
            dst_row = dst_ptr + b.to(tl.int64) * k
            u_first, n = (i - start) * VPR, (end - start) * VPR
            if PREFETCH:
                # The next chunk's row numbers load while this chunk's PCIe reads wait (the
                # loads of one iteration otherwise wait for each other: rows, then words).
                u = u_first + tl.arange(0, VECTORS)
                src, dst = _row_numbers(src_row, dst_row, u, n, VPR)
                for u0 in range(u_first, n, VECTORS):
                    u = u0 + tl.arange(0, VECTORS)
                    nsrc, ndst = _row_numbers(src_row, dst_row, u + VECTORS, n, VPR)
                    _copy_vectors(
                        host_ptr, hot_ptr, src, dst, u, host_rows, hot_rows, VW, VPR,
                        land_ptr, start, land_rows, LANDING,
                    )  # fmt: skip
                    src, dst = nsrc, ndst
            else:
                # STAGES > 1: Triton pipelines the loop, the words' loads becoming asynchronous
                # copies into shared memory, STAGES - 1 chunks ahead (CopyGrid.stages).
                for u0 in tl.range(u_first, n, VECTORS, num_stages=STAGES):
                    u = u0 + tl.arange(0, VECTORS)
                    src, dst = _row_numbers(src_row, dst_row, u, n, VPR)
                    _copy_vectors(
                        host_ptr, hot_ptr, src, dst, u, host_rows, hot_rows, VW, VPR,
                        land_ptr, start, land_rows, LANDING,
                    )  # fmt: skip
            i = end
            start += c
            b += 1


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_programs(device: torch.device, chunks: int = 1 << 30) -> int:
    """Size of the default persistent grid: PROGRAMS_PER_SM per SM on GPU, never more programs
    than `chunks` (of the launch's chunk_bytes: what the largest possible work list holds)."""
    if device.type == "cuda":
        n = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        n *= PROGRAMS_PER_SM
    else:
        n = CPU_PROGRAMS
    return max(1, min(n, chunks))


def _vector_words(words: int) -> int:
    """Words per vector: 4 (16-byte loads and stores) when the row width allows."""
    return next(v for v in (4, 2, 1) if words % v == 0)


def _overridden(
    grid: CopyGrid,
    programs: int | None,
    chunk_bytes: int | None,
    warps: int | None,
    prefetch: bool | None,
) -> CopyGrid:
    """grid with the explicitly given knobs in place of its own (validated as any grid)."""
    knobs = dict(programs=programs, chunk_bytes=chunk_bytes, warps=warps, prefetch=prefetch)
    given: dict[str, Any] = {k: v for k, v in knobs.items() if v is not None}
    # No copy per launch when nothing overrides: the engine's launches pass only the grid.
    return dataclasses.replace(grid, **given) if given else grid


def miss_copy(
    host_rows: Union[torch.Tensor, UVATensor],
    hot_rows: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    chunk_bytes: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
    grid: CopyGrid = ALL_PROGRAMS,
    prefetch: bool | None = None,
    landing: torch.Tensor | None = None,
) -> None:
    """Copy host row miss_src[b, j] to hot row miss_dst[b, j] for j < miss_count[b].

    host_rows: host_kv [N, L, P, D] uint8 (a CPU tensor on CPU, its UVATensor on GPU),
    hot_rows: hot_kv [L, R, B, D] uint8; both are addressed as flat [rows, D].
    miss_src, miss_dst [bs, k] int64 flat row numbers; miss_count [bs] int32 (clamped to [0, k]).
    D must be a multiple of 4. Rows out of range are skipped. Launch-only: graph capturable.
    grid: the whole launch (CopyGrid): the CTAs launched, the rule that picks the working ones
    on the device (default: PROGRAMS_PER_SM per SM, all working), and each working CTA's
    iteration (chunk_bytes, warps, prefetch, stages). The keywords programs, chunk_bytes,
    num_warps and prefetch override the grid's (None: the grid's), for benchmarks that vary one
    knob.
    landing [rows, D] uint8 on the hot buffers' device (the staged copy, staged_copy.py): flat
    work rows below its row count are read from it, row f for flat row f, instead of the host;
    the rest from the host as without it (a source out of range skips its row either way).
    The bytes written are the same for every launch.
    """
    check_copy(host_rows, hot_rows, miss_src, miss_dst, miss_count)
    check_landing(landing, hot_rows)
    grid = _overridden(grid, programs, chunk_bytes, num_warps, prefetch)
    bs, k = miss_src.shape
    if bs == 0 or k == 0:
        return
    D = host_rows.shape[-1]
    vw = _vector_words(D // 4)
    chunks = triton.cdiv(bs * k * D, grid.chunk_bytes)
    # The kernel reads the uint8 tiers as int32 words: passing them as they are spares building
    # views (for a UVATensor, a pinned-memory query) on every launch.
    _miss_copy_kernel[(grid.programs or default_programs(hot_rows.device, chunks),)](
        host_rows,
        hot_rows,
        miss_src,
        miss_dst,
        miss_count,
        bs,
        k,
        math.prod(host_rows.shape) // D,
        hot_rows.numel() // D,
        min(grid.rows_per_program(D), 2**31 - 1),  # an int32 argument
        grid.min_programs,
        hot_rows if landing is None else landing,  # unread without LANDING
        0 if landing is None else landing.shape[0],
        VW=vw,
        VPR=D // 4 // vw,
        VECTORS=grid.chunk_bytes // 16,
        BS_BLOCK=min(BATCH_BLOCK, triton.next_power_of_2(bs)),
        PREFETCH=grid.prefetch,
        STAGES=grid.stages,
        LANDING=landing is not None,
        num_warps=grid.warps,
    )
