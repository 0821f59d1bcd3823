"""bench.profile --torch-glue: the default norm and RoPE become their PyTorch expressions, the
other kernels stay the Triton set's."""

from __future__ import annotations

import argparse
import dataclasses

from bench.shared.glue_args import add_glue_args, glue_kernels
from kernels.kit.kernel_set import KernelSet
from kernels.reference import ref_rms_norm, ref_rotate


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_glue_args(ap)
    return ap.parse_args(list(argv))


def test_the_flag_swaps_norm_and_rope_only() -> None:
    triton = KernelSet.triton()
    glue = glue_kernels(triton, _args("--torch-glue"))
    assert glue.norm is ref_rms_norm and glue.rotate is ref_rotate
    assert triton.norm is not ref_rms_norm and triton.rotate is not ref_rotate
    for f in dataclasses.fields(triton):
        if f.name not in ("norm", "rotate"):
            assert getattr(glue, f.name) == getattr(triton, f.name), f.name


def test_without_the_flag_the_kernels_are_untouched() -> None:
    kernels = KernelSet.triton()
    assert glue_kernels(kernels, _args()) is kernels
