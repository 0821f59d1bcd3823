"""The staged copy's host gather (kernels/swap/host_gather.c through host_gather.py) against
its reference: irregular counts (negative, past the stride), sources outside the tier, chunked
flat ranges, budgets below the total, several threads. Skipped where no C compiler builds it."""

from __future__ import annotations

import pytest
import torch

from kernels.reference.swap import ref_host_gather
from kernels.swap.host_gather import HostGatherUnavailable, host_gather, library

try:
    library()
    BUILT = None
except HostGatherUnavailable as e:  # no compiler: the engine keeps the SM copy
    BUILT = str(e)

pytestmark = pytest.mark.skipif(BUILT is not None, reason=f"host_gather.c: {BUILT}")


def _case(groups, stride, d, host_rows, seed):
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (host_rows * d,), dtype=torch.uint8, generator=g)
    src = torch.randint(-3, host_rows + 3, (groups, stride), generator=g)  # some outside
    count = torch.randint(-2, stride + 3, (groups,), generator=g).to(torch.int32)
    return host, src, count


@pytest.mark.parametrize(
    "groups,stride,d,budget,threads",
    [(1, 1, 4, 1, 1), (7, 13, 656, 40, 3), (5, 33, 1152, 500, 2), (3, 17, 12, 9, 8)],
)
def test_gather_matches_the_reference(groups, stride, d, budget, threads):
    host, src, count = _case(groups, stride, d, 97, groups * stride)
    want = torch.full((budget, d), 7, dtype=torch.uint8)
    got = want.clone()
    ref_host_gather(host, src, count, want)
    host_gather(host, src, count, got, threads=threads)
    assert torch.equal(got, want)


def test_chunks_cover_the_whole_range_and_nothing_outside_it():
    host, src, count = _case(6, 21, 656, 50, 4)
    want = torch.zeros((64, 656), dtype=torch.uint8)
    ref_host_gather(host, src, count, want, first=10, last=47)
    got = torch.zeros_like(want)
    for first, last in ((10, 25), (25, 47)):
        host_gather(host, src, count, got, first=first, last=last, threads=3)
    assert torch.equal(got, want)
    assert not got[:10].any() and not got[47:].any()


def test_bad_buffers_are_refused_before_any_write():
    host, src, count = _case(2, 4, 16, 10, 5)
    staging = torch.zeros((8, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="src"):
        host_gather(host, src.to(torch.int32), count, staging)
    with pytest.raises(ValueError, match="count"):
        host_gather(host, src, count[:1], staging)
    with pytest.raises(ValueError, match="whole rows"):
        host_gather(host[:-1], src, count, staging)
