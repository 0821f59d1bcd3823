"""bench.profile's miss-copy flags reach the kernel set: its chunk and warps, or no copy."""

from __future__ import annotations

import argparse

from bench.shared.copy_args import add_copy_args, copy_kernels
from engine_client.kv.kernel_set import KernelSet


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
