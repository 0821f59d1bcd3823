"""bench.profile's indexer flag: the fp8 index keys scored e4m3 x e4m3 (`indexer_scores`'
query_fp8, V3.2's own numerics) instead of through f16, to time the option in the step before
the engine adopts it (docs/DECISIONS.md, "The fp8 indexer's e4m3 query"). It changes which rows
the indexer selects at the margin, so unlike the attention flags it is not a bits-neutral knob:
the profile's trace top-k does not read the scores, so its step stays comparable."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from kernels.kit.kernel_set import KernelSet


def add_indexer_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--indexer-fp8-query",
        action="store_true",
        help="score fp8 index keys e4m3 x e4m3 (indexer_scores' query_fp8) [off: through f16]",
    )


def indexer_kernels(kernels: KernelSet, args: argparse.Namespace) -> KernelSet:
    """The kernel set with the indexer's fp8 query where --indexer-fp8-query asks for it."""
    if not getattr(args, "indexer_fp8_query", False):
        return kernels
    if not kernels.capturable:  # the torch reference has no such option
        raise ValueError("--indexer-fp8-query configures the Triton indexer: --kernels triton")
    scores = functools.partial(kernels.indexer_scores, query_fp8=True)
    return dataclasses.replace(kernels, indexer_scores=scores)
