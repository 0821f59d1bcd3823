"""bench.profile --indexer-fp8-query: the Triton indexer called with query_fp8, other kernels
untouched, and a clear error for the torch references."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bench.shared.indexer_args import add_indexer_args, indexer_kernels
from kernels.kit.kernel_set import KernelSet


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_indexer_args(ap)
    return ap.parse_args(list(argv))


def test_the_flag_passes_query_fp8_to_the_indexer() -> None:
    seen = []
    fake = dataclasses.replace(KernelSet.triton(), indexer_scores=lambda *a, **kw: seen.append(kw))
    kernels = indexer_kernels(fake, _args("--indexer-fp8-query"))
    kernels.indexer_scores(None, index_format="fp8")
    assert seen == [{"query_fp8": True, "index_format": "fp8"}]
    assert kernels.sparse_mla_decode is fake.sparse_mla_decode


def test_without_the_flag_the_kernels_are_untouched() -> None:
    kernels = KernelSet.triton()
    assert indexer_kernels(kernels, _args()) is kernels


def test_the_references_refuse_the_flag() -> None:
    with pytest.raises(ValueError, match="Triton"):
        indexer_kernels(KernelSet.reference(), _args("--indexer-fp8-query"))
