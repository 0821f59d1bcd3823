"""bench/kernels/copy_span.py's miss lists: runs of consecutive host rows inside the span."""

from __future__ import annotations

import torch

from bench.kernels.copy_span import B, K, run_lists


def test_runs_are_consecutive_rows_inside_the_span():
    for run in (1, 4, 16):
        src, dst, counts = run_lists(5, 0.13, 1000, run, torch.Generator().manual_seed(run), "cpu")
        assert src.shape == dst.shape == (5, K) and counts.shape == (5,)
        assert bool((counts % run == 0).all()) and bool((counts > 0).all())
        assert int(src.min()) >= 0 and int(src.max()) < 1000
        runs = src.view(5, K // run, run)
        assert torch.equal(runs - runs[:, :, :1], torch.arange(run).expand_as(runs))
        for r in range(5):  # destinations: distinct slots of the request's own buffer
            mine = dst[r]
            assert mine.unique().numel() == K
            assert int(mine.min()) >= r * B and int(mine.max()) < (r + 1) * B
