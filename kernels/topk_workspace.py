"""Scratch of the segmented top-k schedule (kernels/topk_segmented.py), allocated once by the
caller so that topk_select allocates nothing (CUDA-graph safe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton


@dataclass(frozen=True)
class TopkWorkspace:
    """Scratch of the segmented schedule, allocated once (CUDA-graph safe), for up to max_batch
    rows of up to max_cols scores: hist [max_batch, S, 2^radix_bits], above, offset, quota
    [max_batch, S] and state [max_batch, 4] int32, arrive [max_batch] int32 (zero between calls),
    with S = ceil(max_cols / segment). segment and radix_bits are fixed here."""

    hist: torch.Tensor
    above: torch.Tensor
    offset: torch.Tensor
    quota: torch.Tensor
    state: torch.Tensor
    arrive: torch.Tensor
    segment: int
    radix_bits: int

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        max_cols: int,
        *,
        segment: int = 4096,
        radix_bits: int = 8,
        device: torch.device | str = "cpu",
    ) -> "TopkWorkspace":
        if segment < 16 or segment % 16 or not 5 <= radix_bits <= 11:
            raise ValueError(
                f"segment must be a multiple of 16 and radix_bits in [5, 11], got "
                f"{segment}, {radix_bits}"
            )
        segs = max(1, triton.cdiv(max_cols, segment))
        # The last program of a pass holds every segment's histogram of its row in registers.
        if triton.next_power_of_2(segs) << radix_bits > 1 << 16:
            raise ValueError(
                f"{segs} segments x 2^{radix_bits} bins is too many: use longer "
                f"segments for {max_cols} columns"
            )

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(
            zeros(max_batch, segs, 1 << radix_bits),
            zeros(max_batch, segs),
            zeros(max_batch, segs),
            zeros(max_batch, segs),
            zeros(max_batch, 4),
            zeros(max_batch),
            segment,
            radix_bits,
        )
