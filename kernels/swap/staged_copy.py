"""The staged miss copy: a part's missed rows gathered by host threads into pinned staging, moved
by the copy engine, and scattered on the device, so that no SM waits on PCIe reads.

The SM copy (miss_copy.py) reads each 656-byte row over PCIe from its CTAs: in the fp8 step it
runs at ~0.47 of a pinned copy on the engine's grid and slows the model's kernels beside it
(issue 38, run AE). Here, per part, on the caller's (side) stream and capturable in a graph:
1. the plan's miss lists and counts come down into pinned memory (two memcpys);
2. `chunks` host functions (cuLaunchHostFunc: C, host_gather.c, no Python on the driver's
   thread) each gather a slice of the flat work list into staging, the first `budget` rows;
3. each slice goes up in one memcpy on a DMA stream as soon as it is gathered, so the next
   slice's gather overlaps it;
4. miss_copy with `landing` scatters the landed rows (HBM to HBM) and reads the rows past the
   budget from the host itself, so a step that misses more than the budget stays exact.
A graph fixes every memcpy's size: each part moves the whole budget whatever its misses.
On CPU the same steps run synchronously (the tests' path).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.swap import host_gather
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.miss_copy import miss_copy


@functools.lru_cache(maxsize=None)
def _launch_host_func():
    """The driver's cuLaunchHostFunc(stream, fn, arg), capturable as a graph's host node."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    return fn


class StagedCopy:
    """Pinned staging and device landing for `budget_rows` rows of `row_bytes`, miss lists of
    up to `max_groups` x `max_stride` entries; `chunks` gather/upload slices; `threads` host
    threads a gather."""

    def __init__(
        self,
        row_bytes: int,
        max_groups: int,
        max_stride: int,
        budget_rows: int,
        device: torch.device,
        *,
        chunks: int = 2,
        threads: int = 8,
    ) -> None:
        if budget_rows < 1 or chunks < 1 or threads < 1 or row_bytes % 4:
            raise ValueError(
                f"budget_rows, chunks and threads must be positive and row_bytes a multiple of "
                f"4: {budget_rows}, {chunks}, {threads}, {row_bytes}"
            )
        self._lib = host_gather.library()  # HostGatherUnavailable here, not mid-step
        self.device, self.chunks, self.threads = device, chunks, threads
        cuda = device.type == "cuda"
        self.src = torch.empty(max_groups * max_stride, dtype=torch.int64, pin_memory=cuda)
        self.count = torch.empty(max_groups, dtype=torch.int32, pin_memory=cuda)
        self.staging = torch.empty((budget_rows, row_bytes), dtype=torch.uint8, pin_memory=cuda)
        self.landing = torch.empty((budget_rows, row_bytes), dtype=torch.uint8, device=device)
        # Jobs by (host pointer, groups, stride): a captured host node keeps its argument's
        # address, so a job lives as long as the copy does.
        self._jobs: dict[tuple[int, int, int], list[host_gather.Job]] = {}
        self._dma = torch.cuda.Stream(device) if cuda else None
        self._gathered = [torch.cuda.Event() for _ in range(chunks)] if cuda else []
        self._landed = torch.cuda.Event() if cuda else None

    def slices(self) -> list[tuple[int, int]]:
        """The flat row ranges of the chunks, covering [0, budget)."""
        n = self.staging.shape[0]
        return [(n * i // self.chunks, n * (i + 1) // self.chunks) for i in range(self.chunks)]

    def _jobs_for(self, host: torch.Tensor, groups: int, stride: int) -> list[host_gather.Job]:
        key = (host.data_ptr(), groups, stride)
        if key not in self._jobs:
            src = self.src[: groups * stride].view(groups, stride)
            self._jobs[key] = [
                host_gather.job(host, src, self.count[:groups], self.staging, a, b, self.threads)
                for a, b in self.slices()
            ]
        return self._jobs[key]

    def copy(self, host_rows, hot_rows, miss_src, miss_dst, miss_count, grid: CopyGrid) -> None:
        """miss_copy's contract (host_rows: the tier, its UVATensor on CUDA), on the current
        stream; graph-capturable on CUDA."""
        groups, stride = miss_src.shape
        if groups * stride > self.src.numel() or groups > self.count.numel():
            raise ValueError(f"miss lists [{groups}, {stride}] exceed the staged copy's buffers")
        host = getattr(host_rows, "tensor", host_rows)  # the C gather reads host addresses
        self.src[: groups * stride].view(groups, stride).copy_(miss_src, non_blocking=True)
        self.count[:groups].copy_(miss_count, non_blocking=True)
        jobs = self._jobs_for(host, groups, stride)
        if self._dma is None:
            for j in jobs:
                self._lib.hg_gather(ctypes.addressof(j))
            self.landing.copy_(self.staging)
        else:
            self._gather_and_upload(jobs)
        miss_copy(
            host_rows, hot_rows, miss_src, miss_dst, miss_count, grid=grid, landing=self.landing
        )

    def _gather_and_upload(self, jobs: list[host_gather.Job]) -> None:
        """Host node i on the current stream, then its slice's memcpy on the DMA stream (so
        gather i + 1 overlaps upload i); the current stream waits for every upload."""
        main, dma, landed = torch.cuda.current_stream(self.device), self._dma, self._landed
        assert dma is not None and landed is not None  # made on CUDA, the only caller
        fn = ctypes.cast(self._lib.hg_gather, ctypes.c_void_p)
        for j, (a, b), gathered in zip(jobs, self.slices(), self._gathered):
            rc = _launch_host_func()(main.cuda_stream, fn, ctypes.addressof(j))
            if rc != 0:
                raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")
            gathered.record(main)
            dma.wait_event(gathered)
            with torch.cuda.stream(dma):
                self.landing[a:b].copy_(self.staging[a:b], non_blocking=True)
        landed.record(dma)
        main.wait_event(landed)
