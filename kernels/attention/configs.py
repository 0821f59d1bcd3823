"""Launch configurations of the two-pass sparse MLA decode, chosen by measurement per shape.

Two kinds of knob, kept apart on purpose:
- BLOCK_T (rows per score tile) fixes where each tile's softmax max is taken, hence the output
  bits. It is one value per row format's kernel variant (`TILE_ROWS`, keyed by
  `kernels.formats.RowKernel`), never a function of the batch, so a row's
  output does not depend on its batch mates (micro-batches and KV modes stay bitwise equal).
- Everything in `LaunchConfig` only moves work between programs: any entry gives the same bits
  (tests/kernels/attention/test_sparse_attention.py checks it), so the table may pick per
  batch size freely.

The table comes from `bench/attention_sweep.py` on the H200 (docs/BENCHMARKS.md, run D): the
fastest measured configuration for each (row format, batch bucket). Run D also compared each
winner's bits with two other launches of the same tiles at every measured shape: equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.formats import RowFormat, RowKernel


@dataclass(frozen=True)
class LaunchConfig:
    """score pass: heads per program, slot-list chunk per program, warps, pipeline stages;
    mix pass: output columns per program, warps, stages, heads per program (fewer heads: a
    smaller accumulator, more programs, each V tile gathered once per head block);
    score_prefetch: the score pass's register prefetch of the next tile; mix_flat: the mix pass
    as one flat loop over tiles; mix_maxnreg: its register cap. The defaults
    fit 64-row tiles of 128 heads in shared memory (score: Q 147 KB + one 74 KB K tile)."""

    score_heads: int = 128
    chunk: int = 512
    score_warps: int = 8
    score_stages: int = 1
    mix_cols: int = 256
    mix_warps: int = 8
    mix_stages: int = 3
    mix_heads: int = 128
    # The score pass gathers tile t + 1 while it computes tile t (registers: fp8 250 a thread).
    score_prefetch: bool = False
    # The mix pass loads each tile's slots where used (two_pass.py's FLAT loop).
    mix_flat: bool = False
    # ptxas's register cap for the mix pass (None: Triton's choice, 255 at the table's fp8
    # entries). At 255 x 256 threads the pass fills an SM's register file and no miss-copy CTA
    # fits beside it; the flat loop at 232 leaves room for one 4-warp copy CTA (8 B of stack).
    mix_maxnreg: int | None = None

    def __post_init__(self) -> None:
        pow2 = (self.score_heads, self.chunk, self.mix_cols, self.mix_heads)
        if any(v < 16 or v & (v - 1) for v in pow2):
            raise ValueError(f"heads, chunk and columns must be powers of two >= 16: {self}")
        if min(self.score_warps, self.mix_warps, self.score_stages, self.mix_stages) < 1:
            raise ValueError(f"warps and stages must be positive: {self}")
        if self.mix_maxnreg is not None and not 32 <= self.mix_maxnreg <= 255:
            raise ValueError(f"mix_maxnreg must be in 32..255 registers: {self}")


# Rows per score tile, per row format (see the module doc). Measured (docs/BENCHMARKS.md, run
# D): 64-row tiles beat 32 for bf16 at every batch (bs 64: 180.5 vs 189.5 us) and tie for fp8
# at bs 64-128 (204.1 vs 206.7, 400.6 vs 399.8 us) while winning at bs 8 (62.9 vs 75.5).
TILE_ROWS: dict[RowKernel, int] = {RowKernel.BF16: 64, RowKernel.FP8: 64}

# (row kernel variant, largest batch of the bucket) -> config, buckets ascending. Each bucket
# holds the fastest (score, mix) pair that bench/attention_sweep.py measured at bs 8, 64 and 128
# (run D, H200); the bs <= 4 entry is extrapolated from bs 8 (a shorter chunk keeps programs busy).
# Every measured winner launches ~128 score programs at k 2048 (ceil(k / chunk) x bs: one wave on
# 132 SMs), and the score time is linear in bs at a full wave (~1.8 us a request at bs 8, 64 and
# 128). The bs 17-32 entry follows that rule instead of bs 64's: a micro-batch part at N 61 holds
# 30 requests, and with chunk 1024 and 256 mix columns both passes launched 60 programs, half a
# wave (run T, H100: two parts of 30 took 1.54 ms of attention a step against 0.85 ms for one of
# 61). Chunk 512 gives 120 score programs; mix 128 columns on 4 warps, 120 mix programs (run D at
# bs 64: a 128/4 mix program takes about half a 256/8 one's time). Run T4 (H100): attention of
# two parts at N 61 1.54 -> 1.06 ms a step, the step 8.07 ms against one part's 8.53; the launch
# sweep at bs 30 is still to run (bench/NOTES-datapath.md).
# fp8 65-128 (run V, H100, `attention_sweep --batches 56,74,111 --formats fp8 --quick`): the parts
# of N 222 (2 parts of 111, 3 of 74). Chunk 256 (8 score programs a request, several waves of
# short programs) beat the longer chunks in the score pass (64-row tiles): bs 111 218.8 us vs
# 235.6 at chunk 2048, bs 74 153.0 vs 176.8 at chunk 512 (2048: slower still); at bs 74 the
# 128-column mix on 4 warps beat 256 on 8 (152.2 vs 169.0 us). bs 128 and above keep run D's
# H200 entry (not re-measured).
_SMALL = LaunchConfig(chunk=128, mix_cols=64, mix_warps=4, mix_stages=4)
_PART = LaunchConfig(chunk=512, mix_cols=128, mix_warps=4, mix_stages=3)
TABLE: dict[RowKernel, list[tuple[int, LaunchConfig]]] = {
    RowKernel.BF16: [
        (4, LaunchConfig(chunk=64, mix_cols=64, mix_warps=4, mix_stages=4)),
        (16, _SMALL),
        (32, _PART),
        (64, LaunchConfig(chunk=1024)),
        (1 << 30, LaunchConfig(chunk=2048)),
    ],
    RowKernel.FP8: [
        (4, LaunchConfig(chunk=64, mix_cols=64, mix_warps=4, mix_stages=4)),
        (16, _SMALL),
        (32, _PART),
        (64, LaunchConfig(chunk=1024)),
        (96, LaunchConfig(chunk=256, mix_cols=128, mix_warps=4, mix_stages=3)),
        (128, LaunchConfig(chunk=256)),
        (1 << 30, LaunchConfig(chunk=2048)),
    ],
}


def launch_config(row_format: RowFormat, batch: int) -> LaunchConfig:
    """The measured-best configuration for `batch` rows of `row_format` (by its kernel variant)."""
    if row_format.kernel not in TABLE:
        raise ValueError(f"row format {row_format.name} has no two-pass attention kernel")
    return next(cfg for top, cfg in TABLE[row_format.kernel] if batch <= top)
