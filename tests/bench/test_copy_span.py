"""The miss lists of bench/kernels/copy_span.py (miss_copy_cases.miss_lists with `run`): runs of
consecutive host rows inside the span."""

from __future__ import annotations

import torch

from bench.kernels.miss_copy_cases import B, K, miss_lists


def test_runs_are_consecutive_rows_inside_the_span():
    for run in (1, 4, 16):
        g = torch.Generator().manual_seed(run)
        src, dst, counts = miss_lists(5, 0.13, 1000, g, run, "cpu")
        assert src.shape == dst.shape == (5, K) and counts.shape == (5,)
        assert bool((counts % run == 0).all()) and bool((counts > 0).all())
        assert int(src.min()) >= 0 and int(src.max()) < 1000
        runs = src.view(5, K // run, run)
        assert torch.equal(runs - runs[:, :, :1], torch.arange(run).expand_as(runs))
        for r in range(5):  # destinations: distinct slots of the request's own buffer
            mine = dst[r]
            assert mine.unique().numel() == K
            assert int(mine.min()) >= r * B and int(mine.max()) < (r + 1) * B
