"""bench.e2e's switches of the engines under test: each mode's engine gets the same ones (the
HiSparse-only ones go to the embedded and service engines alone, bench/e2e/run_args.py)."""

from __future__ import annotations

import argparse

from bench.shared.copy_args import copy_grid_spec
from kernels.swap.copy_grid import SPEC_GRAMMAR


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The decode step's shape (micro-batches, part tail, late queries) and admission, then the
    miss copy's launch."""
    ap.add_argument(
        "--microbatches",
        type=int,
        default=2,
        help="embedded/service engines: decode parts whose miss copy overlaps compute "
        "[2, the engine's default; 1: off]",
    )
    ap.add_argument(
        "--admission-limit",
        default="auto",
        help="the engines' --admission-limit [auto: adaptive in the HiSparse modes; off: every "
        "mode admits up to its max N, as before the limit]",
    )
    ap.add_argument(
        "--decode-part-tail",
        action="store_true",
        help="every engine (baseline too: the model splits its GEMMs alike in all modes) runs "
        "each decode part's layer tail right after its attention (engine --decode-part-tail)",
    )
    ap.add_argument(
        "--late-queries",
        action="store_true",
        help="every engine launches each layer's attention queries after every part's swap-in "
        "plan (engine --decode-late-queries; same bits)",
    )
    _add_copy_args(ap)


def _add_copy_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--copy-priority",
        type=int,
        default=0,
        help="the HiSparse engines' --decode-copy-priority: the miss-copy stream's CUDA priority "
        "(-1: before the compute stream's waiting CTAs) [0]",
    )
    ap.add_argument(
        "--copy-grid",
        type=copy_grid_spec,
        default="",
        metavar="SPEC",
        help="the HiSparse engines' --decode-copy-grid: the miss copy's launch as "
        f"bench.profile.copy_sweep names it ({SPEC_GRAMMAR}) [the engine's default]",
    )
