"""The miss copy's flags of bench.profile and bench.profile.copy_sweep: its launch on the side
stream (CopyGrid: one spec, or its parts), its chunk, or no copy at all (timing only)."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from engine_client.kv.hisparse import OVERLAP_COPY_GRID
from kernels.kit.kernel_set import KernelSet
from kernels.swap.copy_grid import SPEC_GRAMMAR, CopyGrid, check_spec


def add_copy_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--copy-grid",
        type=copy_grid_spec,
        default="",
        metavar="SPEC",
        help=f"the side-stream copy's whole launch, as the engine's --decode-copy-grid: "
        f"{SPEC_GRAMMAR}; instead of --copy-programs/--copy-bytes/--copy-min [none]",
    )
    ap.add_argument(
        "--copy-programs",
        type=int,
        default=0,
        help="CTAs the side-stream miss copy launches, all working unless --copy-bytes "
        "[0: the backend's OVERLAP_COPY_GRID]",
    )
    ap.add_argument(
        "--copy-bytes",
        type=int,
        default=0,
        help="miss bytes per working CTA of the side-stream copy (CopyGrid.bytes_per_program) "
        "[0: with --copy-programs, all work; alone, the backend's grid]",
    )
    ap.add_argument(
        "--copy-min", type=int, default=1, help="fewest working CTAs under --copy-bytes [1]"
    )
    ap.add_argument(
        "--copy-priority",
        type=int,
        default=0,
        help="the side stream's CUDA priority (-1: the copy's CTAs are scheduled before the "
        "main stream's waiting ones) [0: the default, as the main stream]",
    )
    _add_kernel_args(ap)


def _add_kernel_args(ap: argparse.ArgumentParser) -> None:
    """The copy kernel's own knobs, apart from its grid."""
    ap.add_argument(
        "--copy-chunk",
        type=int,
        default=0,
        help="bytes per working CTA per iteration of the miss copy (a power of 2) "
        "[0: the kernel's default]",
    )
    ap.add_argument(
        "--copy-warps",
        type=int,
        default=0,
        help="warps per CTA of the miss copy (2 with --copy-chunk 4096 keeps 4 vectors a thread "
        "and fits beside more kernels: bench/kernels/coresidency.py) [0: the kernel's 4]",
    )
    ap.add_argument(
        "--skip-copy",
        action="store_true",
        help="timing only, wrong outputs: no miss copy, to measure what the copy adds to the step",
    )


def copy_grid_spec(text: str) -> str:
    """argparse type of a --copy-grid flag: a typo fails at parsing, before anything runs."""
    try:
        return check_spec(text) if text else text  # "": none given (argparse parses defaults)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def copy_grid(args: argparse.Namespace) -> CopyGrid:
    """The side-stream copy's grid the --copy-* flags ask for (--copy-chunk and --copy-warps
    apply on top, through copy_kernels)."""
    if args.copy_grid:
        if args.copy_programs or args.copy_bytes or args.copy_min != 1:
            raise ValueError("--copy-grid names the whole grid: drop --copy-programs/bytes/min")
        grid = CopyGrid.parse(args.copy_grid, default=OVERLAP_COPY_GRID)
        return dataclasses.replace(grid, priority=args.copy_priority)
    if not (args.copy_programs or args.copy_bytes):
        return dataclasses.replace(OVERLAP_COPY_GRID, priority=args.copy_priority)
    return CopyGrid(
        programs=args.copy_programs or OVERLAP_COPY_GRID.programs,
        bytes_per_program=args.copy_bytes,
        min_programs=args.copy_min,
        priority=args.copy_priority,
    )


def copy_kernels(kernels: KernelSet, args: argparse.Namespace) -> KernelSet:
    """The kernel set with the miss copy the flags ask for: none (--skip-copy), or its chunk
    and warps."""
    if args.skip_copy:
        return dataclasses.replace(kernels, miss_copy=lambda *a, **kw: None)
    knobs = {"chunk_bytes": args.copy_chunk, "num_warps": args.copy_warps}
    knobs = {k: v for k, v in knobs.items() if v}
    if knobs:
        return dataclasses.replace(kernels, miss_copy=functools.partial(kernels.miss_copy, **knobs))
    return kernels
