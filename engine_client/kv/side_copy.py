"""The overlapped miss copy: each micro-batch part's copy on a side stream, beside the main
stream's compute, and the wait attention does before it reads the part's rows.

The launch is a CopyGrid (kernels/swap/copy_grid.py): the SM copy's CTAs and rule, the side
stream's priority, SMs of its own (`sms`: the model then runs on the rest, `compute_stream`),
and the staged copy (`staged_bytes`: host threads and the copy engine move each part's first
misses, kernels/swap/staged_copy.py).
"""

from __future__ import annotations

import torch

from kernels.kit.kernel_set import KernelSet
from kernels.sm_partition import split_sms
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.staged_copy import StagedCopy


class SideCopy:
    """The side stream, its grid, one event per part (by the part's first row) and, when the
    grid stages, the staged copy's buffers for parts of up to `rows` x `k` misses."""

    def __init__(
        self,
        grid: CopyGrid,
        device: torch.device,
        kernels: KernelSet,
        row_bytes: int,
        rows: int,
        k: int,
    ) -> None:
        self.device, self.kernels = device, kernels
        self._sizes = (row_bytes, rows, k)
        self._copied: dict[int, torch.cuda.Event] = {}
        self.grid = grid
        self.compute_stream: torch.cuda.Stream | None = None
        self.stream = self._side_stream(grid)
        self.staged = self._staged(grid)
        # Staged copies a grid switch replaced: a graph captured before the switch holds their
        # buffers and host-node arguments by address, and replaying it after they were freed
        # crashes the process (run AF: a benchmark did). Kept for the backend's life.
        self._retired: list[StagedCopy] = []

    def _side_stream(self, grid: CopyGrid) -> torch.cuda.Stream:
        """The copy's stream; with grid.sms, on SMs of its own, and the model's kernels then
        run on the rest (`compute_stream`, which the model runner launches on)."""
        if not grid.sms:
            return torch.cuda.Stream(self.device, priority=grid.priority)
        part = split_sms(grid.sms, self.device)
        self.compute_stream = part.rest
        return part.small

    def _staged(self, grid: CopyGrid) -> StagedCopy | None:
        """The staged copy's buffers for the grid's budget; None when it does not stage. A C
        compiler that cannot build the host gather fails here (HostGatherUnavailable)."""
        row_bytes, rows, k = self._sizes
        if not grid.staged_bytes:
            return None
        budget = max(1, grid.staged_bytes // row_bytes)
        return StagedCopy(
            row_bytes,
            rows,
            k,
            budget,
            self.device,
            chunks=grid.staged_chunks,
            threads=grid.staged_threads,
        )

    def set_grid(self, grid: CopyGrid) -> None:
        """Later copies on `grid` (a sweep's; recapture after): a new side stream where its
        stream settings differ, new staging where its staged copy does."""
        old, self.grid = self.grid, grid
        if (old.sms, old.priority) != (grid.sms, grid.priority):
            self.compute_stream = None
            self.stream = self._side_stream(grid)
        staged = (grid.staged_bytes, grid.staged_chunks, grid.staged_threads)
        if (old.staged_bytes, old.staged_chunks, old.staged_threads) != staged:
            if self.staged is not None:
                self._retired.append(self.staged)
            self.staged = self._staged(grid)

    def copy(self, row0: int, host_rows, hot_kv, src, dst, count) -> None:
        """The part's miss copy on the side stream, after what the main stream queued so far."""
        main, side = torch.cuda.current_stream(self.device), self.stream
        done = self._copied.setdefault(row0, torch.cuda.Event())
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if self.staged is not None:
                self.staged.copy(host_rows, hot_kv, src, dst, count, grid=self.grid)
            else:
                self.kernels.miss_copy(host_rows, hot_kv, src, dst, count, grid=self.grid)
            done.record(side)

    def ready(self, row0: int) -> None:
        """Before attention reads the rows of the part starting at row0: wait for its copy."""
        torch.cuda.current_stream(self.device).wait_event(self._copied[row0])
