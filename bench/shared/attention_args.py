"""The sparse attention's launch flag of bench.profile and its copy sweep: the two-pass decode's
mix pass in another configuration than the measured table's (kernels/attention/configs.py).

Why: the table was measured with attention alone on the GPU. In the micro-batched step the miss
copy runs beside it, and the table's mix pass (256 columns, 8 warps, 255 registers a thread)
fills an SM's register file, so no copy CTA can run beside it (bench/kernels/coresidency.py).
A lighter mix pass may be slower alone and faster in the step. Every configuration gives the
same bits (LaunchConfig only moves work between programs)."""

from __future__ import annotations

import argparse
import dataclasses

from kernels.attention.configs import LaunchConfig, launch_config
from kernels.formats import BF16_ROW
from kernels.kit.kernel_set import KernelSet


def add_attention_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--attn-mix",
        default="",
        help="COLUMNS:WARPS:STAGES of the two-pass decode's mix pass, e.g. 128:8:3 "
        "[the measured table's; any gives the same bits]",
    )
    ap.add_argument(
        "--attn-mix-flat",
        action="store_true",
        help="the mix pass as one flat loop over tiles (LaunchConfig.mix_flat; same bits) "
        "[the table's: off]",
    )
    ap.add_argument(
        "--attn-mix-maxnreg",
        type=int,
        default=None,
        help="ptxas's register cap for the mix pass (LaunchConfig.mix_maxnreg; same bits): "
        "232 leaves room for a miss-copy CTA beside it [Triton's choice]",
    )
    ap.add_argument(
        "--attn-score-prefetch",
        action="store_true",
        help="the score pass gathers each K tile one tile ahead (LaunchConfig.score_prefetch; "
        "same bits) [the table's: off]",
    )


def mix_override(text: str) -> dict[str, int]:
    """`COLUMNS:WARPS:STAGES` as LaunchConfig fields (ValueError on a malformed one)."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--attn-mix takes COLUMNS:WARPS:STAGES, e.g. 128:8:3, got {text!r}")
    cols, warps, stages = (int(p) for p in parts)
    fields = {"mix_cols": cols, "mix_warps": warps, "mix_stages": stages}
    dataclasses.replace(LaunchConfig(), **fields)  # validates
    return fields


def attention_kernels(kernels: KernelSet, args: argparse.Namespace) -> KernelSet:
    """The kernel set with the mix pass that --attn-mix asks for, and the score pass's prefetch
    where --attn-score-prefetch asks for it (else the table's launch)."""
    prefetch = getattr(args, "attn_score_prefetch", False)
    flat = getattr(args, "attn_mix_flat", False)
    maxnreg = getattr(args, "attn_mix_maxnreg", None)
    if not args.attn_mix and not prefetch and not flat and maxnreg is None:
        return kernels
    if not kernels.capturable:  # the torch references take no launch configuration
        raise ValueError("--attn-* flags configure the Triton kernels: run with --kernels triton")
    fields = mix_override(args.attn_mix) if args.attn_mix else {}
    fields |= {"score_prefetch": True} if prefetch else {}
    fields |= {"mix_flat": True} if flat else {}
    fields |= {"mix_maxnreg": maxnreg} if maxnreg is not None else {}
    attend = kernels.sparse_mla_decode

    def decode(q_nope, *a, row_format=BF16_ROW, launch=None, **kw) -> None:
        cfg = launch or launch_config(row_format, q_nope.shape[0])
        cfg = dataclasses.replace(cfg, **fields)
        attend(q_nope, *a, row_format=row_format, launch=cfg, **kw)

    return dataclasses.replace(kernels, sparse_mla_decode=decode)
