"""Miss copy: move the rows a swap plan missed from the host tier into the hot buffers.

On GPU the host tier is a `kernels.uva.UVATensor`: the kernel loads the pinned host rows directly
over PCIe, so the miss list never round-trips through the CPU.

Grid: a persistent grid of a few programs per SM walks one flat work list, the concatenation of
every request's miss list. Counts are only known on the device (the plan kernel writes them in
the same graph), so every program scans them itself: per chunk of ROWS flat rows it finds each
row's request by comparing with the counts' running sums. A grid of one program per (request,
miss chunk) would launch bs * k / ROWS mostly empty programs (32,768 at bs 128, ~23 µs with no
miss at all) and leave the busy ones scattered across waves.

Rows are moved as int32 words; the row width is a compile-time constant so the compiler can prove
16-byte alignment and emit 128-bit loads and stores for both row formats (1152 B = 72 x 16 B,
656 B = 41 x 16 B). Masked lanes of the power-of-two tile issue no memory traffic.
"""

from __future__ import annotations

import functools
import math
from typing import Union

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.uva import UVATensor

ROWS_PER_PROGRAM = 8
# Programs per SM of the persistent grid: enough rows in flight to cover PCIe latency (each
# program keeps ROWS rows of loads outstanding) while every program stays resident.
PROGRAMS_PER_SM = 8
# Requests scanned per vector step of the work-list search.
BATCH_BLOCK = 256
CPU_PROGRAMS = 4


@triton.jit
def _chunk_rows(count_ptr, i, bs, k, BS_BLOCK: tl.constexpr):
    """Request b and index j in its list of flat work-list rows i (i past the end: b = bs)."""
    b = tl.zeros_like(i)
    first = tl.zeros_like(i)
    off = 0
    for blk in range(0, bs, BS_BLOCK):
        r = blk + tl.arange(0, BS_BLOCK)
        c = tl.minimum(tl.maximum(tl.load(count_ptr + r, mask=r < bs, other=0), 0), k)
        ends = off + tl.cumsum(c, 0)
        before = ends[None, :] <= i[:, None]
        b += tl.sum(before.to(tl.int32), axis=1)
        first += tl.sum(tl.where(before, c[None, :], 0), axis=1)
        off += tl.sum(c, 0)
    return b, i - first


@triton.jit
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
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
    BS_BLOCK: tl.constexpr,
):
    host_ptr = host_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    hot_ptr = hot_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    total = 0
    for blk in range(0, bs, BS_BLOCK):
        r = blk + tl.arange(0, BS_BLOCK)
        c = tl.load(count_ptr + r, mask=r < bs, other=0)
        total += tl.sum(tl.minimum(tl.maximum(c, 0), k), 0)
    w = tl.arange(0, BLOCK_W)
    # A step without misses ends here, after one scan of the counts.
    for chunk in range(tl.program_id(0), tl.cdiv(total, ROWS), tl.num_programs(0)):
        i = chunk * ROWS + tl.arange(0, ROWS)
        b, j = _chunk_rows(count_ptr, i, bs, k, BS_BLOCK)
        live = i < total
        at = b.to(tl.int64) * k + j
        src = tl.load(src_ptr + at, mask=live, other=-1)
        dst = tl.load(dst_ptr + at, mask=live, other=-1)
        # A row outside either tier is a caller bug: skip it rather than touch foreign memory.
        ok = live & (src >= 0) & (src < host_rows) & (dst >= 0) & (dst < hot_rows)
        mask = ok[:, None] & (w < WORDS)[None, :]
        words = tl.load(host_ptr + src[:, None] * WORDS + w[None, :], mask=mask)
        tl.store(hot_ptr + dst[:, None] * WORDS + w[None, :], words, mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_programs(
    device: torch.device, rows_per_program: int = ROWS_PER_PROGRAM, bs: int = 1 << 30, k: int = 1
) -> int:
    """Size of the persistent grid: PROGRAMS_PER_SM per SM on GPU, never more programs than
    chunks the largest possible work list (bs * k rows) has."""
    if device.type == "cuda":
        n = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        n *= PROGRAMS_PER_SM
    else:
        n = CPU_PROGRAMS
    return max(1, min(n, triton.cdiv(bs * k, rows_per_program)))


def _check(host_rows, hot_rows, miss_src, miss_dst, miss_count) -> None:
    D = host_rows.shape[-1]
    if hot_rows.shape[-1] != D or D % 4 != 0:
        raise ValueError(f"row bytes must match and be a multiple of 4: {D}, {hot_rows.shape[-1]}")
    if host_rows.dtype != torch.uint8 or hot_rows.dtype != torch.uint8:
        raise ValueError("host_rows and hot_rows must be uint8")
    if not (host_rows.is_contiguous() and hot_rows.is_contiguous()):
        raise ValueError("host_rows and hot_rows must be contiguous")
    if hot_rows.is_cuda and isinstance(host_rows, torch.Tensor) and not host_rows.is_cuda:
        raise TypeError("on GPU pass the host tier as a kernels.uva.UVATensor")
    if miss_src.dim() != 2:
        raise ValueError(f"miss_src: expected [bs, k], got {tuple(miss_src.shape)}")
    bs, k = miss_src.shape
    for name, x, dtype, shape in (
        ("miss_src", miss_src, torch.int64, (bs, k)),
        ("miss_dst", miss_dst, torch.int64, (bs, k)),
        ("miss_count", miss_count, torch.int32, (bs,)),
    ):
        if x.dtype != dtype or tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(
                f"{name}: expected contiguous {shape} {dtype}, got {tuple(x.shape)} {x.dtype}"
            )


def miss_copy(
    host_rows: Union[torch.Tensor, UVATensor],
    hot_rows: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = 4,
    programs: int | None = None,
) -> None:
    """Copy host row miss_src[b, j] to hot row miss_dst[b, j] for j < miss_count[b].

    host_rows: host_kv [N, L, P, D] uint8 (a CPU tensor on CPU, its UVATensor on GPU),
    hot_rows: hot_kv [L, R, B, D] uint8; both are addressed as flat [rows, D].
    miss_src, miss_dst [bs, k] int64 flat row numbers; miss_count [bs] int32 (clamped to [0, k]).
    D must be a multiple of 4. Rows out of range are skipped. Launch-only: graph capturable.
    Tuning knobs for the benchmark: rows_per_program (a power of 2: rows in flight per program
    per iteration), num_warps, programs (persistent grid size; default PROGRAMS_PER_SM per SM,
    a bound on the CTAs the copy occupies).
    """
    _check(host_rows, hot_rows, miss_src, miss_dst, miss_count)
    bs, k = miss_src.shape
    if bs == 0 or k == 0:
        return
    D = host_rows.shape[-1]
    grid = (
        programs
        if programs is not None
        else default_programs(hot_rows.device, rows_per_program, bs, k),
    )
    if grid[0] <= 0:
        raise ValueError(f"programs must be positive, got {programs}")
    # The kernel reads the uint8 tiers as int32 words: passing them as they are spares building
    # views (for a UVATensor, a pinned-memory query) on every launch.
    _miss_copy_kernel[grid](
        host_rows,
        hot_rows,
        miss_src,
        miss_dst,
        miss_count,
        bs,
        k,
        math.prod(host_rows.shape) // D,
        hot_rows.numel() // D,
        WORDS=D // 4,
        BLOCK_W=triton.next_power_of_2(D // 4),
        ROWS=rows_per_program,
        BS_BLOCK=min(BATCH_BLOCK, triton.next_power_of_2(bs)),
        num_warps=num_warps,
    )
