"""bench.profile's miss-copy flags reach the kernel set (its chunk and warps, or no copy) and
the side stream's grid (one spec, or its parts)."""

from __future__ import annotations

import argparse

import pytest

from bench.shared.copy_args import add_copy_args, copy_grid, copy_kernels
from engine_client.kv.hisparse import OVERLAP_COPY_GRID
from kernels.kit.kernel_set import KernelSet
from kernels.swap.copy_grid import CopyGrid


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_copy_args(ap)
    return ap.parse_args(list(argv))


def test_chunk_and_warps_reach_the_copy() -> None:
    ks = KernelSet.triton()
    copy = copy_kernels(ks, _args("--copy-chunk", "4096", "--copy-warps", "2")).miss_copy
    assert copy.func is ks.miss_copy
    assert copy.keywords == {"chunk_bytes": 4096, "num_warps": 2}
    assert copy_kernels(ks, _args("--copy-warps", "2")).miss_copy.keywords == {"num_warps": 2}


def test_without_flags_the_copy_is_the_kernels_own_and_skip_copy_copies_nothing() -> None:
    ks = KernelSet.triton()
    assert copy_kernels(ks, _args()) is ks
    assert copy_kernels(ks, _args("--skip-copy")).miss_copy(None, None) is None


def test_one_spec_names_the_whole_grid() -> None:
    grid = copy_grid(_args("--copy-grid", "8@64Kx32p", "--copy-priority", "-1"))
    assert grid == CopyGrid(8, chunk_bytes=64 << 10, warps=32, prefetch=True, priority=-1)
    assert copy_grid(_args("--copy-grid", "default")) == OVERLAP_COPY_GRID
    assert copy_grid(_args()) == OVERLAP_COPY_GRID
    with pytest.raises(ValueError, match="--copy-grid"):
        copy_grid(_args("--copy-grid", "8", "--copy-programs", "16"))
    with pytest.raises(SystemExit):
        _args("--copy-grid", "8@64Kx3")
