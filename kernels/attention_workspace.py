"""Scratch buffers of sparse_mla_decode, allocated once so a CUDA graph can capture the calls.

`TileWorkspace` (the two-pass decode, kernels/attention_two_pass.py) holds each request's tile
probabilities; `AttnWorkspace` the split-k partials of the fused kernel. Their shapes depend on
the top-k and the row format, never on a batch: a row's output bits do not depend on the rows
it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton

from kernels.attention_configs import TILE_ROWS
from kernels.formats import BF16_ROW, LATENT_DIM, RowFormat


@dataclass(frozen=True)
class AttnWorkspace:
    """Split-k scratch of sparse_mla_decode, allocated once (CUDA-graph safe): normalized partial
    outputs part_out [max_bs, S, H, D_V] (fp32, or bf16 for half the traffic), running maxima
    (log2 units) part_max and sums part_sum [max_bs, S, H] fp32. S, the split count, is fixed
    here, never by the batch: a row's output bits do not depend on its batch mates."""

    part_out: torch.Tensor
    part_max: torch.Tensor
    part_sum: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.part_out.shape[1]

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        num_splits: int,
        *,
        d_v: int = LATENT_DIM,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "AttnWorkspace":
        if num_splits < 1 or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"need num_splits >= 1 and an fp32/bf16 workspace, got {num_splits} {dtype}"
            )
        shape = (max_batch, num_splits, num_heads)
        return cls(
            torch.empty(shape + (d_v,), dtype=dtype, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )


def decode_num_splits(topk: int) -> int:
    """Split count for decode workspaces: a function of k alone (batch-invariant bits), about one
    split per 1024 slots, at most 8."""
    return max(1, min(8, topk // 1024))


def check_split_workspace(ws: AttnWorkspace, bs: int, n_heads: int, d_v: int) -> None:
    cap, splits, heads, width = ws.part_out.shape
    if (
        cap < bs
        or heads != n_heads
        or width != d_v
        or not ws.part_out.is_contiguous()
        or tuple(ws.part_max.shape) != (cap, splits, heads)
        or not ws.part_max.is_contiguous()
        or ws.part_sum.shape != ws.part_max.shape
        or not ws.part_sum.is_contiguous()
    ):
        raise ValueError(
            f"workspace {tuple(ws.part_out.shape)} does not fit batch {bs}, "
            f"{n_heads} heads of width {d_v}"
        )


@dataclass(frozen=True)
class TileWorkspace:
    """Two-pass scratch: probabilities p [max_bs, n_tiles, H, block_t] bf16 (each tile's
    exp2(score - tile max)), tile maxima [max_bs, n_tiles, H] fp32 (log2 units, integers) and
    tile sums in 2^-40 fixed point [max_bs, n_tiles, H] int64.
    n_tiles = ceil(topk / block_t); block_t (TILE_ROWS of the row format's kernel) fixes the
    bits."""

    probs: torch.Tensor
    tile_max: torch.Tensor
    tile_sum: torch.Tensor

    @property
    def block_t(self) -> int:
        return self.probs.shape[-1]

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        topk: int,
        *,
        row_format: RowFormat = BF16_ROW,
        block_t: int | None = None,
        device: torch.device | str = "cpu",
    ) -> "TileWorkspace":
        """block_t: rows per tile [TILE_ROWS of the row format's kernel] (benchmarks sweep it)."""
        tile_rows = 0 if row_format.kernel is None else TILE_ROWS.get(row_format.kernel, 0)
        bt = block_t or tile_rows
        if not tile_rows or topk < 1 or max_batch < 1 or num_heads < 1 or bt < 16:
            raise ValueError(
                f"bad tile workspace: batch {max_batch}, {num_heads} heads, top-k {topk}, "
                f"row format {row_format.describe()}"
            )
        shape = (max_batch, triton.cdiv(topk, bt), num_heads)
        return cls(
            torch.empty(shape + (bt,), dtype=torch.bfloat16, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.int64, device=device),
        )

    def check(self, bs: int, n_heads: int, k: int) -> None:
        cap, tiles, heads, bt = self.probs.shape
        same = (cap, tiles, heads)
        if (
            cap < bs
            or heads != n_heads
            or tiles * bt < k
            or not all(t.is_contiguous() for t in (self.probs, self.tile_max, self.tile_sum))
            or tuple(self.tile_max.shape) != same
            or tuple(self.tile_sum.shape) != same
            or self.tile_sum.dtype != torch.int64
            or bt < 16
            or bt & (bt - 1)
        ):
            raise ValueError(
                f"tile workspace {tuple(self.probs.shape)} does not fit batch {bs}, "
                f"{n_heads} heads, top-k {k}"
            )
