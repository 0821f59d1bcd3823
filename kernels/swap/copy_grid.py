"""The miss copy's whole launch: how many CTAs it launches, how many of them the step's misses
put to work, and what each working CTA does per iteration (chunk bytes, warps, prefetch).

A CUDA graph fixes the launched grid and the miss counts exist only on the device, so the copy
launches `programs` CTAs and each of them derives the working count from the counts it sums
anyway: active = ceil(miss bytes / bytes_per_program), clamped to [min_programs, programs]; the
others exit at once. Beside compute (the micro-batched step's side stream) every working CTA
slows the memory-bound kernels of the SM it shares, so the copy should hold no more CTAs than
keep it in time: issue 38 measured the fp8 step 14.07 ms at 24 CTAs, 16.21 at 64 and 20.87 at 8
(12.28 without the copy) at 14% misses, while at 87% misses 64 beat 24. A rule that follows the
bytes serves both. `bench/profile/copy_sweep.py` measures the step over its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CopyGrid:
    """programs: CTAs launched (None: the kernel's default, a few per SM, at most one per chunk
    of the largest work list). bytes_per_program: miss bytes per working CTA (0: all launched
    CTAs work). min_programs: the fewest working CTAs when there is any miss (capped by
    programs). priority: the side stream's CUDA priority (lower runs first; 0, the default, is
    also the lowest and the main stream's): below 0 the block scheduler places the copy's CTAs
    before the main stream's waiting ones, so the copy is not queued behind a full grid.
    chunk_bytes: bytes each working CTA keeps in flight per iteration, a power-of-two tile of
    16-byte vectors (8 KiB: 4 vectors per thread of 4 warps, 40 registers on sm_90; the copy is
    latency bound per CTA, a PCIe read per iteration, so this and the working CTAs set its
    rate). warps: per CTA. prefetch: load the next chunk's row numbers during this chunk's
    reads (one fewer serial load per iteration for more registers: 63 instead of 40 at 8 KiB)."""

    programs: int | None = None
    bytes_per_program: int = 0
    min_programs: int = 1
    priority: int = 0
    chunk_bytes: int = 8192
    warps: int = 4
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"programs must be positive, got {self.programs}")
        if self.priority > 0:
            raise ValueError(f"priority must be <= 0 (0 is the lowest), got {self.priority}")
        if self.bytes_per_program < 0 or self.min_programs < 1:
            raise ValueError(
                f"bytes_per_program must be >= 0 and min_programs >= 1, got "
                f"{self.bytes_per_program}, {self.min_programs}"
            )
        if self.chunk_bytes < 16 or not _power_of_two(self.chunk_bytes):
            raise ValueError(f"chunk_bytes must be a power of 2 >= 16, got {self.chunk_bytes}")
        if not (1 <= self.warps <= 32 and _power_of_two(self.warps)):
            raise ValueError(f"warps must be a power of 2 in 1..32, got {self.warps}")

    def _tail(self) -> str:
        """`@CHUNK[xWARPS][p]`, or nothing when the iteration is the default one."""
        if (self.chunk_bytes, self.warps, self.prefetch) == (8192, 4, False):
            return ""
        warps = f"x{self.warps}" if self.warps != 4 else ""
        chunk = f"{self.chunk_bytes >> 10}K" if self.chunk_bytes >= 1024 else self.chunk_bytes
        return f"@{chunk}{warps}{'p' if self.prefetch else ''}"

    def rows_per_program(self, row_bytes: int) -> int:
        """Miss rows per working CTA for rows of row_bytes (0: every launched CTA works)."""
        if self.bytes_per_program == 0:
            return 0
        return max(1, self.bytes_per_program // row_bytes)

    def active(self, total_rows: int, row_bytes: int, launched: int) -> int:
        """The working CTAs for total_rows misses (what each CTA of the kernel computes)."""
        per = self.rows_per_program(row_bytes)
        if per == 0:
            return launched
        return max(min(self.min_programs, launched), min(-(-total_rows // per), launched))

    def label(self) -> str:
        """Short name for benchmark tables: 'fixed 64', '<=64 >=16 768K', '<=64 >=8 2M @16Kx8p'
        (the iteration only where it is not the default)."""
        top = "default" if self.programs is None else str(self.programs)
        tail = f" {self._tail()}" if self._tail() else ""
        prio = f" prio {self.priority}" if self.priority else ""
        if self.bytes_per_program == 0:
            return f"fixed {top}{tail}{prio}"
        n = self.bytes_per_program
        size = f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 1024:g}K" if n >= 1024 else f"{n}B"
        return f"<={top} >={self.min_programs} {size}{tail}{prio}"


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
