"""Launch configurations of the two-pass sparse MLA decode, chosen by measurement per shape.

Two kinds of knob, kept apart on purpose:
- BLOCK_T (rows per score tile) fixes where each tile's softmax max is taken, hence the output
  bits. It is one value per row format (`TILE_ROWS`), never a function of the batch, so a row's
  output does not depend on its batch mates (micro-batches and KV modes stay bitwise equal).
- Everything in `LaunchConfig` only moves work between programs: any entry gives the same bits
  (tests/test_sparse_attention.py checks it), so the table may pick per batch size freely.

The table comes from `bench/attention_sweep.py` on the H200 (docs/BENCHMARKS.md, "attention
sweep"): the fastest measured configuration for each (row format, batch bucket).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """score pass: heads per program, slot-list chunk per program, warps, pipeline stages,
    register prefetch; mix pass: output columns per program, warps, stages."""

    score_heads: int = 128
    chunk: int = 512
    score_warps: int = 8
    score_stages: int = 2
    # Score pass: next tile's rows loaded into registers while this one is worked on (with
    # score_stages 1; the chunk's slots all in registers: chunk <= 2048).
    score_prefetch: bool = False
    mix_cols: int = 256
    mix_warps: int = 8
    mix_stages: int = 3

    def __post_init__(self) -> None:
        pow2 = (self.score_heads, self.chunk, self.mix_cols)
        if any(v < 16 or v & (v - 1) for v in pow2):
            raise ValueError(f"heads, chunk and columns must be powers of two >= 16: {self}")
        if min(self.score_warps, self.mix_warps, self.score_stages, self.mix_stages) < 1:
            raise ValueError(f"warps and stages must be positive: {self}")
        if self.score_prefetch and self.chunk > 2048:
            raise ValueError(f"a prefetching score pass holds at most 2048 slots: {self}")


# Rows per score tile, per row format (see the module doc).
TILE_ROWS = {"bf16": 64, "fp8": 64}

# (row format, largest batch of the bucket) -> config, buckets ascending.
_SMALL = LaunchConfig(chunk=64, score_stages=1, mix_cols=64, mix_warps=4, mix_stages=4)
TABLE: dict[str, list[tuple[int, LaunchConfig]]] = {
    "bf16": [
        (4, _SMALL),
        (16, LaunchConfig(chunk=128, score_stages=1, mix_cols=64, mix_warps=4, mix_stages=4)),
        (64, LaunchConfig(chunk=1024, score_stages=1)),
        (1 << 30, LaunchConfig(chunk=2048, score_stages=1)),
    ],
    "fp8": [
        (4, _SMALL),
        (16, LaunchConfig(chunk=128, score_stages=1, mix_cols=64, mix_warps=4, mix_stages=4)),
        (64, LaunchConfig(chunk=1024, score_stages=1, score_prefetch=True)),
        (1 << 30, LaunchConfig(chunk=2048, score_stages=1, score_prefetch=True)),
    ],
}


def launch_config(row_format: str, batch: int) -> LaunchConfig:
    """The measured-best configuration for `batch` rows of `row_format` ("bf16" or "fp8")."""
    return next(cfg for top, cfg in TABLE[row_format] if batch <= top)
