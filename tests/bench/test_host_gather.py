"""bench/kernels/host_gather.py's native gather (host_gather.c): the rows an index list names,
in its order, on irregular sizes and thread counts; skipped where gcc cannot build it."""

from __future__ import annotations

import shutil

import pytest
import torch

from bench.kernels.host_gather import native_gather


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build host_gather.c")
@pytest.mark.parametrize("n,d,threads", [(1, 656, 1), (777, 656, 2), (13, 1152, 3)])
def test_native_gather_copies_the_named_rows_in_order(n, d, threads):
    g = torch.Generator().manual_seed(n)
    host = torch.randint(0, 255, (1000, d), dtype=torch.uint8, generator=g)
    idx = torch.randint(0, 1000, (n,), generator=g)
    out = torch.zeros((n, d), dtype=torch.uint8)
    gather = native_gather(host, threads)
    assert gather is not None
    gather(idx, out)
    assert torch.equal(out, host[idx])
