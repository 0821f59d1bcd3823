"""Where a prefill engine's NIXL writes read a prompt's KV from (`--transfer-source`).

- auto (the default): staged on CUDA, direct on CPU. Run AE (H100, 8K-token prompts of 46 MB)
  measured a staged write 12.4 ms (3.7 GB/s) against 167 ms direct: UCX stages device memory
  itself, in small pieces.

- direct: the baseline cache itself is registered, host memory (DRAM) on CPU and device memory
  (VRAM) on CUDA, so on a GPU the rows go from the device straight into the decode side's
  pinned host pages (UCX's CUDA transports move them; no copy of ours).
- staged: a pinned host buffer of one request's pages is registered instead; each export first
  gathers the request's pages into it (one device-to-host copy per tensor), then writes from
  it. Its rows are page-major like the decode side's host tier ([page, L, P, D]), so a page is
  one span whatever L, and consecutive pages on both sides one span
  (`contract.transfer_target.merged`); the direct source, layer-major, needs a span per layer
  and page. The fallback where NIXL cannot register device memory (a UCX without CUDA
  support), and the comparison the benchmark makes (bench/disagg.py). On CPU it is an extra
  host copy: the tests use it to check the staged path without a GPU.
- gathered: staged's page-major buffer in the cache's own memory (device memory on CUDA,
  registered as VRAM): the gather is a device copy, and the write goes from the device as
  direct's does, but in staged's few spans. It costs one request's pages of device memory
  beside the cache. On CPU it is staged without pinning.
One staging buffer: staged and gathered exports are written one at a time (a lock), direct ones
at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from contract.nixl_agent import NixlAgent
from contract.transfer_target import INDEX, ROWS, SOURCES

log = logging.getLogger(__name__)


class ExportSource:
    """The registered regions a write reads from, and the pages of a request in them."""

    def __init__(self, agent: NixlAgent, rows: torch.Tensor, index: torch.Tensor, page: int):
        """rows [L, N * P (+ sink), D] and index [L, N (+ sink), P, I] of the baseline cache
        (`page`: P); registers them as they are."""
        self.agent, self.device = agent, rows.device
        self.name = "direct"
        agent.register(ROWS, rows, rows.stride(0), page * rows.stride(1))
        agent.register(INDEX, index, index.stride(0), index.stride(1))

    @contextmanager
    def pages(self, src_pages: Sequence[int]) -> Iterator[Sequence[int]]:
        """The request's pages as the registered regions hold them, while the write runs."""
        with self._device():
            yield src_pages

    def _device(self) -> AbstractContextManager[object]:
        # The write runs on a worker thread: UCX's CUDA transports use the thread's current
        # context, so the cache's device is made current there.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()


class StagedSource(ExportSource):
    """A copy of one request's pages at a time: pinned host memory registered as DRAM
    (staged), or, `on_device`, the cache's own memory (gathered: VRAM on CUDA)."""

    def __init__(
        self,
        agent: NixlAgent,
        rows: torch.Tensor,
        index: torch.Tensor,
        page: int,
        most: int,
        on_device: bool = False,
    ) -> None:
        """`most`: the most pages one request holds (max_context / P)."""
        self.agent, self.device = agent, rows.device
        self.name = "gathered" if on_device else "staged"
        L, N, D = rows.shape[0], index.shape[1] - 1, rows.shape[-1]
        # The cache's rows by page (the sink row after the last page left out).
        self._paged = rows[:, : N * page].view(L, N, page, D)
        self._index = index
        alloc = {"device": self.device} if on_device else {"pin_memory": self.device.type == "cuda"}
        # Rows page-major (the host tier's geometry), index keys layer-major (the index pool's).
        self.rows_stage = torch.empty((most, L, page, D), dtype=torch.uint8, **alloc)
        self.index_stage = torch.empty((L, most, *index.shape[2:]), dtype=torch.uint8, **alloc)
        stage, keys = self.rows_stage, self.index_stage
        agent.register(ROWS, stage, stage.stride(1), stage.stride(0))
        agent.register(INDEX, keys, keys.stride(0), keys.stride(1))
        self._lock = threading.Lock()

    @contextmanager
    def pages(self, src_pages: Sequence[int]) -> Iterator[Sequence[int]]:
        """Gathers the pages into the staging buffers (page i of the request at page i) and
        holds them until the write is done."""
        n, paged = len(src_pages), self._paged
        with self._lock, self._device():
            where = torch.tensor(src_pages, dtype=torch.int64, device=self.device)
            # [L, n, P, D] gathered, copied page-major into the stage (a strided copy: on the
            # device for gathered; for staged PyTorch packs it on the device before the D2H).
            self.rows_stage[:n].copy_(paged.index_select(1, where).transpose(0, 1))
            self.index_stage[:, :n].copy_(self._index.index_select(1, where))
            if self.rows_stage.is_cuda:  # a device copy is queued; UCX reads on its own stream
                torch.cuda.current_stream(self.device).synchronize()
            yield range(n)


def export_source(
    agent: NixlAgent, rows: torch.Tensor, index: torch.Tensor, page: int, most: int, name: str
) -> ExportSource:
    """The source `name` names; direct or gathered on a GPU whose device memory NIXL cannot
    register (or that has no room for gathered's buffer) falls back to staged (logged)."""
    if name not in SOURCES:
        raise ValueError(f"transfer source {name!r}: one of {', '.join(SOURCES)}")
    if name == "auto":  # NIXL writes from device memory at ~0.3-0.5 GB/s here, from pinned ~4
        name = "staged" if rows.device.type == "cuda" else "direct"
    if name == "staged":
        return StagedSource(agent, rows, index, page, most)
    try:
        if name == "gathered":
            return StagedSource(agent, rows, index, page, most, on_device=True)
        return ExportSource(agent, rows, index, page)
    except Exception as e:  # NIXL's own errors (the memory type refused), or out of memory
        if rows.device.type != "cuda":
            raise
        log.warning(
            "NIXL cannot register the cache on %s (%r): staged through host", rows.device, e
        )
        for region in agent.regions:
            agent.deregister(region.name)
        return StagedSource(agent, rows, index, page, most)
