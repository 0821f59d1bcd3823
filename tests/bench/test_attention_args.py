"""bench.profile --attn-mix and --attn-score-prefetch: the mix pass in the given configuration,
the score pass as the measured table has it (with its prefetch where asked), and clear errors
for a malformed flag or the reference kernels."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bench.shared.attention_args import add_attention_args, attention_kernels
from kernels.attention.configs import launch_config
from kernels.formats import FP8_ROW
from kernels.kit.kernel_set import KernelSet


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_attention_args(ap)
    return ap.parse_args(list(argv))


class _Q:
    shape = (96, 128, 512)


def test_the_mix_pass_takes_the_flag_and_the_score_pass_the_table() -> None:
    seen = []
    fake = dataclasses.replace(
        KernelSet.triton(), sparse_mla_decode=lambda *a, **kw: seen.append(kw["launch"])
    )
    attention_kernels(fake, _args("--attn-mix", "128:8:2")).sparse_mla_decode(
        _Q(), None, row_format=FP8_ROW, workspace=None
    )
    table = launch_config(FP8_ROW, 96)
    assert seen == [dataclasses.replace(table, mix_cols=128, mix_warps=8, mix_stages=2)]


def test_the_loop_flags_keep_the_rest_of_the_table() -> None:
    seen = []
    fake = dataclasses.replace(
        KernelSet.triton(), sparse_mla_decode=lambda *a, **kw: seen.append(kw["launch"])
    )
    attention_kernels(fake, _args("--attn-score-prefetch")).sparse_mla_decode(
        _Q(), None, row_format=FP8_ROW, workspace=None
    )
    attention_kernels(fake, _args("--attn-mix-flat")).sparse_mla_decode(
        _Q(), None, row_format=FP8_ROW, workspace=None
    )
    table = launch_config(FP8_ROW, 96)
    assert seen == [
        dataclasses.replace(table, score_prefetch=True),
        dataclasses.replace(table, mix_flat=True),
    ]


def test_without_the_flag_the_kernels_are_untouched() -> None:
    kernels = KernelSet.triton()
    assert attention_kernels(kernels, _args()) is kernels


@pytest.mark.parametrize("bad", ["128:8", "128:8:x", "100:8:3", "128:0:3"])
def test_a_malformed_flag_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        attention_kernels(KernelSet.triton(), _args("--attn-mix", bad))


def test_the_references_refuse_a_launch_configuration() -> None:
    with pytest.raises(ValueError, match="Triton"):
        attention_kernels(KernelSet.reference(), _args("--attn-mix", "128:8:3"))
