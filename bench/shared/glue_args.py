"""bench.profile's glue flag: the model's default RMSNorm and RoPE through their PyTorch
expressions (`ref_rms_norm`, `ref_rotate`: ~9 and ~8 launches a call) instead of the Triton set's
kernels (kernels/dense/rms_norm.py, rope.py), so one call times the step both ways. Bits-neutral:
the kernels equal the expressions bit for bit (tests/kernels/dense)."""

from __future__ import annotations

import argparse
import dataclasses

from kernels.kit.kernel_set import KernelSet
from kernels.reference import ref_rms_norm, ref_rotate


def add_glue_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--torch-glue",
        action="store_true",
        help="RMSNorm and RoPE as PyTorch expressions, not kernels/dense's fused kernels "
        "(same bits; to time the kernels in the step)",
    )


def glue_kernels(kernels: KernelSet, args: argparse.Namespace) -> KernelSet:
    """The kernel set with PyTorch's norm and RoPE where --torch-glue asks for them."""
    if not getattr(args, "torch_glue", False):
        return kernels
    return dataclasses.replace(kernels, norm=ref_rms_norm, rotate=ref_rotate)
