"""How the engine loop batches its work: the most requests per step, the prompt tokens of a
prefill chunk, whether step t + 1 launches before step t's tokens reach the host, and the
decode step's microbatches (and whether each part runs its own layer tail)."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, within
from kernels.swap.copy_grid import SPEC_GRAMMAR, check_spec


def _copy_grid(name: str, value: str) -> None:
    """Only the spec's form: the backend, which owns the `default` grid, reads it at assembly."""
    if value:
        try:
            check_spec(value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


@dataclass(frozen=True)
class Batching:
    max_batch: int = setting(
        8, help="most requests admitted and decoded together", check=within(1, 4096)
    )
    prefill_chunk: int = setting(
        32, help="prompt tokens per prefill chunk (one chunk per step)", check=within(1, 65536)
    )
    # The engine loop (engine_client/loop/engine.py).
    overlap: bool = setting(
        True,
        help="launch decode step t + 1 before step t's tokens reach "
        "the host (0: wait for every step; debugging)",
    )
    # HiSparseBackend.microbatches. On by default (docs/DECISIONS.md, copy/compute overlap):
    # 2 parts cut the H200 step at 32K x 128 requests from 11.55 to 9.97 ms (bench/profile.py).
    decode_microbatches: int = setting(
        2,
        help="embedded/service: split each decode step into "
        "this many parts whose host->GPU miss copy overlaps the "
        "other parts' compute; 1 = off",
        check=within(1, 64),
    )
    # Model.tail_parts (engine_client/model/part_tail.py): off by default, measured slower (run S:
    # each part re-reads the GEMM weights; docs/DECISIONS.md, issue 38).
    decode_part_tail: bool = setting(
        False,
        help="decode: each of the --decode-microbatches parts runs its "
        "layer tail (o_proj, MLP) right after its attention, beside the next part's miss copy "
        "(every KV mode splits the same way)",
    )
    # Model.late_queries (docs/DECISIONS.md, "The attention's queries after every part's plan"):
    # off until a profile shows the step dropping.
    decode_late_queries: bool = setting(
        False,
        help="decode: launch each layer's attention queries (q_b_proj, W_UK, q_pe's RoPE) after "
        "every micro-batch part's swap-in plan, beside the miss copies (same bits)",
    )

    # CopyGrid.priority of HiSparseBackend's side stream (kernels/swap/copy_grid.py). Off by
    # default: one H100 profile (docs/BENCHMARKS.md, run S) gave -0.51 ms of a 16.44 ms fp8 step
    # at -1, not yet measured end to end (bench.e2e --copy-priority).
    decode_copy_priority: int = setting(
        0,
        help="embedded/service with --decode-microbatches > 1: the CUDA priority of the stream "
        "that copies the misses (-1: its CTAs are scheduled before the compute stream's waiting "
        "ones; lower is higher, the device clamps to its range) [0: the compute stream's]",
        check=within(-8, 0),
    )
    # The rest of that launch (kernels/swap/copy_grid.py): CTAs, the rule for the working ones,
    # chunk, warps, prefetch. For running a launch a sweep (bench/profile/copy_sweep.py) picked;
    # the default stays the measured OVERLAP_COPY_GRID (docs/DECISIONS.md, issue 38 item 2).
    decode_copy_grid: str = setting(
        "",
        help="embedded/service with --decode-microbatches > 1: the launch of the side-stream "
        f"miss copy, as bench.profile.copy_sweep names it: {SPEC_GRAMMAR}; `default` is the "
        "backend's grid [empty: the backend's grid, engine_client/kv/hisparse.py "
        "OVERLAP_COPY_GRID]",
        check=_copy_grid,
    )

    def __post_init__(self) -> None:
        check_settings(self)
