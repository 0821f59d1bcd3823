"""Miss copy: move the rows a swap plan missed from the host tier into the hot buffers.

On GPU the host tier is a `kernels.uva.UVATensor`: the kernel loads the pinned host rows directly
over PCIe, so the miss list never round-trips through the CPU. Rows are moved as int32 words; the
row width is a compile-time constant so the compiler can prove 16-byte alignment and emit 128-bit
loads and stores for both row formats (1152 B = 72 x 16 B, 656 B = 41 x 16 B).
"""

from __future__ import annotations

import math
from typing import Union

import torch
import triton
import triton.language as tl

from kernels.uva import UVATensor

ROWS_PER_PROGRAM = 8


@triton.jit
def _miss_copy_kernel(host_ptr, hot_ptr, src_ptr, dst_ptr, count_ptr, k, host_rows, hot_rows,
                      WORDS: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr):
    host_ptr = host_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    hot_ptr = hot_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    b = tl.program_id(0)
    start = tl.program_id(1) * ROWS
    count = tl.minimum(tl.load(count_ptr + b), k)
    # Most programs of a mostly-hit step find no rows of theirs: leave before touching memory.
    if start >= count:
        return
    j = start + tl.arange(0, ROWS)
    live = j < count
    src = tl.load(src_ptr + b.to(tl.int64) * k + j, mask=live, other=-1)
    dst = tl.load(dst_ptr + b.to(tl.int64) * k + j, mask=live, other=-1)
    # A row outside either tier is a caller bug: skip it rather than touch foreign memory.
    ok = live & (src >= 0) & (src < host_rows) & (dst >= 0) & (dst < hot_rows)
    w = tl.arange(0, BLOCK_W)
    mask = ok[:, None] & (w < WORDS)[None, :]
    words = tl.load(host_ptr + src[:, None] * WORDS + w[None, :], mask=mask)
    tl.store(hot_ptr + dst[:, None] * WORDS + w[None, :], words, mask=mask)


def miss_copy(host_rows: Union[torch.Tensor, UVATensor], hot_rows: torch.Tensor,
              miss_src: torch.Tensor, miss_dst: torch.Tensor, miss_count: torch.Tensor, *,
              rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = 4) -> None:
    """Copy host row miss_src[b, j] to hot row miss_dst[b, j] for j < miss_count[b].

    host_rows: host_kv [N, L, P, D] uint8 (a CPU tensor on CPU, its UVATensor on GPU),
    hot_rows: hot_kv [L, R, B, D] uint8; both are addressed as flat [rows, D].
    miss_src, miss_dst [bs, k] int64 flat row numbers; miss_count [bs] int32 (clamped to k).
    D must be a multiple of 4. Rows out of range are skipped. Launch-only: graph capturable.
    rows_per_program (a power of 2) and num_warps are tuning knobs for the benchmark.
    """
    D = host_rows.shape[-1]
    if hot_rows.shape[-1] != D or D % 4 != 0:
        raise ValueError(f"row bytes must match and be a multiple of 4: {D}, {hot_rows.shape[-1]}")
    if host_rows.dtype != torch.uint8 or hot_rows.dtype != torch.uint8:
        raise ValueError("host_rows and hot_rows must be uint8")
    if not (host_rows.is_contiguous() and hot_rows.is_contiguous()):
        raise ValueError("host_rows and hot_rows must be contiguous")
    if hot_rows.is_cuda and isinstance(host_rows, torch.Tensor) and not host_rows.is_cuda:
        raise TypeError("on GPU pass the host tier as a kernels.uva.UVATensor")
    bs, k = miss_src.shape
    for name, x, dtype, shape in (("miss_src", miss_src, torch.int64, (bs, k)),
                                  ("miss_dst", miss_dst, torch.int64, (bs, k)),
                                  ("miss_count", miss_count, torch.int32, (bs,))):
        if x.dtype != dtype or tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(f"{name}: expected contiguous {shape} {dtype}, "
                             f"got {tuple(x.shape)} {x.dtype}")
    if bs == 0 or k == 0:
        return
    grid = (bs, triton.cdiv(k, rows_per_program))
    # The kernel reads the uint8 tiers as int32 words: passing them as they are spares building
    # views (for a UVATensor, a pinned-memory query) on every launch.
    _miss_copy_kernel[grid](host_rows, hot_rows, miss_src, miss_dst, miss_count, k,
                            math.prod(host_rows.shape) // D, hot_rows.numel() // D, WORDS=D // 4,
                            BLOCK_W=triton.next_power_of_2(D // 4), ROWS=rows_per_program,
                            num_warps=num_warps)

