"""The miss copy's whole launch: how many CTAs it launches, how many of them the step's misses
put to work, and what each working CTA does per iteration (chunk bytes, warps, prefetch).

A CUDA graph fixes the launched grid and the miss counts exist only on the device, so the copy
launches `programs` CTAs and each of them derives the working count from the counts it sums
anyway: active = ceil(miss bytes / bytes_per_program), clamped to [min_programs, programs]; the
others exit at once. Beside compute (the micro-batched step's side stream) every working CTA
slows the memory-bound kernels of the SM it shares, so the copy should hold no more CTAs than
keep it in time: issue 38 measured the fp8 step 14.07 ms at 24 CTAs, 16.21 at 64 and 20.87 at 8
(12.28 without the copy) at 14% misses, while at 87% misses 64 beat 24. A rule that follows the
bytes serves both. `bench/profile/copy_sweep.py` measures the step over its parameters, named by
the spec `CopyGrid.parse` reads (SPEC_GRAMMAR); the engine takes one (--decode-copy-grid).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

SPEC_GRAMMAR = (
    "default | P | P/MIN/BYTES, then optionally @CHUNK[xWARPS][p|sSTAGES], then optionally gSMS, "
    "then optionally +hSTAGED[cCHUNKS][tTHREADS] (BYTES, CHUNK and STAGED take K/M suffixes; e.g. "
    "24, 64/8/1.5M, 8@64Kx32, 64/8/2M@16Kx8p, 8@64Kx32g8, 24@8Ks2, default+h24M, 64+h16Mc4t12)"
)
_NUM = r"\d+(?:\.\d+)?[KkMm]?"
_SPEC = re.compile(
    rf"(?P<body>default|\d+|\d+/\d+/{_NUM})"
    rf"(?:@(?P<chunk>{_NUM})(?:x(?P<warps>\d+))?(?P<prefetch>p)?(?:s(?P<stages>\d+))?)?"
    r"(?:g(?P<sms>\d+))?"
    rf"(?:\+h(?P<staged>{_NUM})(?:c(?P<staged_chunks>\d+))?(?:t(?P<staged_threads>\d+))?)?"
)


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
    reads (one fewer serial load per iteration for more registers: 63 instead of 40 at 8 KiB).
    stages: chunks in flight a working CTA keeps through asynchronous copies into shared memory
    (Triton's pipelining of the loop, LDGSTS on sm_90): 1, the plain loop; 2 adds one chunk
    ahead for chunk_bytes of shared memory and 44 registers instead of 40 at 8 KiB (Triton
    3.7.1; 3: 64 registers, 2 chunks). Not with prefetch.
    sms: SMs of the copy's own (kernels/sm_partition.py): the side stream runs on a group of at
    least `sms` SMs and the model's kernels on the rest, so neither waits for the other's CTAs
    to leave an SM; 0 (the default): both share every SM. Like priority, the streams'.
    staged_bytes: each part's first misses, up to these bytes, go through the staged copy
    (kernels/swap/staged_copy.py: host threads gather them, the copy engine moves them, no SM
    reads host memory), the rest as before; 0 (the default): off. A graph fixes the upload, so
    every part moves the whole budget. staged_chunks: gather/upload slices a part (the gather
    of one overlaps the upload of the last); staged_threads: host threads a gather."""

    programs: int | None = None
    bytes_per_program: int = 0
    min_programs: int = 1
    priority: int = 0
    chunk_bytes: int = 8192
    warps: int = 4
    prefetch: bool = False
    sms: int = 0
    stages: int = 1
    staged_bytes: int = 0
    staged_chunks: int = 2
    staged_threads: int = 8

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
        if self.sms < 0:
            raise ValueError(f"sms must be >= 0 (0: no SMs of its own), got {self.sms}")
        if not 1 <= self.stages <= 4 or (self.stages > 1 and self.prefetch):
            raise ValueError(f"stages must be in 1..4, and 1 with prefetch, got {self.stages}")
        if self.staged_bytes < 0 or self.staged_chunks < 1 or self.staged_threads < 1:
            raise ValueError(
                f"staged_bytes must be >= 0, staged_chunks and staged_threads positive, got "
                f"{self.staged_bytes}, {self.staged_chunks}, {self.staged_threads}"
            )

    @classmethod
    def parse(cls, spec: str, default: CopyGrid | None = None) -> CopyGrid:
        """The grid a spec names (SPEC_GRAMMAR): `default` is `default` (the caller's grid:
        the engine's lives above the kernels), `P` is P CTAs all working, `P/MIN/BYTES` the rule;
        the tail sets chunk_bytes, warps, prefetch, stages (unset: the body's), `gSMS` the copy's
        own SMs. priority is the stream's, not the launch's: the body's (0 for P and
        P/MIN/BYTES)."""
        m = _SPEC.fullmatch(spec)
        if m is None:
            raise ValueError(f"bad copy grid spec {spec!r}: expected {SPEC_GRAMMAR}")
        try:
            grid = _staged(_body(m["body"], default), m)
            if m["sms"] is not None:
                grid = dataclasses.replace(grid, sms=int(m["sms"]))
            if m["chunk"] is None:
                return grid
            return dataclasses.replace(
                grid,
                chunk_bytes=_bytes(m["chunk"]),
                warps=int(m["warps"]) if m["warps"] else grid.warps,
                prefetch=bool(m["prefetch"]) or grid.prefetch,
                stages=int(m["stages"]) if m["stages"] else grid.stages,
            )
        except ValueError as e:
            raise ValueError(f"bad copy grid spec {spec!r}: {e}; expected {SPEC_GRAMMAR}") from None

    def spec(self) -> str:
        """The spec `parse` reads back as this grid (priority aside: it is the stream's)."""
        if self.programs is None:
            raise ValueError("the kernel's default launch (programs None) has no spec")
        body = str(self.programs)
        if self.bytes_per_program or self.min_programs != 1:
            body += f"/{self.min_programs}/{_size(self.bytes_per_program)}"
        return body + self._tail() + (f"g{self.sms}" if self.sms else "") + self._staged_tail()

    def _staged_tail(self) -> str:
        """`+hSTAGED[cCHUNKS][tTHREADS]`, or nothing when the staged copy is off."""
        if not self.staged_bytes:
            return ""
        chunks = f"c{self.staged_chunks}" if self.staged_chunks != CopyGrid.staged_chunks else ""
        t = f"t{self.staged_threads}" if self.staged_threads != CopyGrid.staged_threads else ""
        return f"+h{_size(self.staged_bytes)}{chunks}{t}"

    def _tail(self) -> str:
        """`@CHUNK[xWARPS][p]`, or nothing when the iteration is the default one."""
        # The class attributes are the fields' defaults: the default iteration, declared once.
        if (self.chunk_bytes, self.warps, self.prefetch, self.stages) == (
            CopyGrid.chunk_bytes,
            CopyGrid.warps,
            CopyGrid.prefetch,
            CopyGrid.stages,
        ):
            return ""
        warps = f"x{self.warps}" if self.warps != CopyGrid.warps else ""
        ahead = "p" if self.prefetch else f"s{self.stages}" if self.stages > 1 else ""
        return f"@{_size(self.chunk_bytes)}{warps}{ahead}"

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
        tail = self._tail()
        tail = f" {tail}" if tail else ""
        prio = f" prio {self.priority}" if self.priority else ""
        prio += f" own {self.sms} SMs" if self.sms else ""
        prio += f" staged {self._staged_tail()[2:]}" if self.staged_bytes else ""
        if self.bytes_per_program == 0:
            return f"fixed {top}{tail}{prio}"
        n = self.bytes_per_program
        size = f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 1024:g}K" if n >= 1024 else f"{n}B"
        return f"<={top} >={self.min_programs} {size}{tail}{prio}"


def check_spec(spec: str) -> str:
    """The spec unchanged if `CopyGrid.parse` reads it (its form only: `default` is checked
    against the kernel's default grid, the caller's own being out of reach), else ValueError."""
    CopyGrid.parse(spec, default=CopyGrid())
    return spec


def _body(body: str, default: CopyGrid | None) -> CopyGrid:
    if body == "default":
        if default is None:
            raise ValueError("`default` needs the caller's grid")
        return default
    if "/" in body:
        p, low, per = body.split("/")
        return CopyGrid(programs=int(p), bytes_per_program=_bytes(per), min_programs=int(low))
    return CopyGrid(programs=int(body))


def _staged(grid: CopyGrid, m: re.Match) -> CopyGrid:
    """grid with the spec's `+h` tail (unset: the grid's own staged copy)."""
    if m["staged"] is None:
        return grid
    return dataclasses.replace(
        grid,
        staged_bytes=_bytes(m["staged"]),
        staged_chunks=int(m["staged_chunks"] or CopyGrid.staged_chunks),
        staged_threads=int(m["staged_threads"] or CopyGrid.staged_threads),
    )


def _bytes(text: str) -> int:
    """`1536`, `8K`, `1.5M` -> bytes (a fraction must come out whole)."""
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    value = float(text.rstrip("KMkm")) * scale
    if value != int(value):
        raise ValueError(f"{text} is not a whole number of bytes")
    return int(value)


def _size(n: int) -> str:
    """Bytes as the shortest text `_bytes` reads back exactly: 1M, 1.5M, 768K, 100."""
    for scale, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        text = f"{n / scale:g}{suffix}"
        if n >= scale and "e" not in text and _bytes(text) == n:
            return text
    return str(n)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
