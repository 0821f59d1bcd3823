"""The staged miss copy (kernels/swap/staged_copy.py) and miss_copy's landing source: rows
below the landing's count come from it, the rest from the host, out-of-range rows skipped; the
staged copy writes the bytes the SM copy writes, whatever its budget against the misses, its
chunks and threads, on the guarded buffers of test_miss_copy.py. Skipped where host_gather.c
does not build."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.reference import ref_miss_copy
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.host_gather import HostGatherUnavailable, library
from kernels.swap.miss_copy import miss_copy
from kernels.swap.staged_copy import StagedCopy
from kernels.uva import UVATensor
from tests.kernels.swap.test_miss_copy import DEVICES, GUARD, SENTINEL, miss_lists, rows_tensor

try:
    library()
    BUILT = None
except HostGatherUnavailable as e:
    BUILT = str(e)


def _tiers(device, D, bs, k, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    on_gpu = torch.device(device).type == "cuda"
    host_n, hot_n = 3 * bs * k + 5, 2 * bs * k + 7
    host, _ = rows_tensor((host_n, D), device, g, pinned=on_gpu)
    hot, hot_buf = rows_tensor((hot_n, D), device, g)
    src, dst, count = miss_lists(rng, bs, k, host_n, hot_n, device)
    return (UVATensor(host) if on_gpu else host), host, hot, hot_buf, (src, dst, count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("landed", [0, 1, 9, 200])
def test_landing_rows_replace_the_host_rows_below_their_count(device, landed):
    tier, host, hot, hot_buf, lists = _tiers(device, 656, 5, 13, landed)
    g = torch.Generator().manual_seed(landed + 1)
    landing = torch.randint(0, 256, (landed, 656), dtype=torch.uint8, generator=g).to(device)
    want = hot_buf.clone()
    miss_copy(tier, hot, *lists, grid=CopyGrid(programs=3, chunk_bytes=256), landing=landing)
    ref_miss_copy(host, want[GUARD:-GUARD].view(hot.shape), *lists, landing=landing)
    assert torch.equal(hot_buf, want)
    assert (hot_buf[:GUARD] == SENTINEL).all() and (hot_buf[-GUARD:] == SENTINEL).all()


def test_a_landing_of_another_shape_or_device_is_refused():
    tier, _, hot, _, lists = _tiers("cpu", 656, 2, 3, 0)
    for bad in (torch.zeros((4, 652), dtype=torch.uint8), torch.zeros((4, 656))):
        with pytest.raises(ValueError, match="landing"):
            miss_copy(tier, hot, *lists, landing=bad)


@pytest.mark.skipif(BUILT is not None, reason=f"host_gather.c: {BUILT}")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget,chunks,threads", [(1, 1, 1), (17, 3, 2), (400, 2, 4)])
def test_staged_copy_writes_what_the_sm_copy_writes(device, budget, chunks, threads):
    """Budgets below, inside and past the misses (5 x 13 at most, some rows out of range)."""
    tier, host, hot, hot_buf, lists = _tiers(device, 656, 5, 13, budget)
    want = hot_buf.clone()
    ref_miss_copy(host, want[GUARD:-GUARD].view(hot.shape), *lists)
    staged = StagedCopy(656, 8, 13, budget, torch.device(device), chunks=chunks, threads=threads)
    staged.copy(tier, hot, *lists, grid=CopyGrid(programs=4, chunk_bytes=1024))
    assert torch.equal(hot_buf.cpu(), want.cpu())
    # A second part of another size through the same buffers (the next micro-batch).
    tier2, host2, hot2, hot_buf2, lists2 = _tiers(device, 656, 3, 11, budget + 1)
    want2 = hot_buf2.clone()
    ref_miss_copy(host2, want2[GUARD:-GUARD].view(hot2.shape), *lists2)
    staged.copy(tier2, hot2, *lists2, grid=CopyGrid(programs=4, chunk_bytes=1024))
    assert torch.equal(hot_buf2.cpu(), want2.cpu())


@pytest.mark.skipif(BUILT is not None, reason=f"host_gather.c: {BUILT}")
def test_lists_larger_than_the_buffers_are_refused():
    tier, _, hot, _, lists = _tiers("cpu", 656, 5, 13, 3)
    staged = StagedCopy(656, 4, 13, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceed"):
        staged.copy(tier, hot, *lists, grid=CopyGrid(programs=2))
