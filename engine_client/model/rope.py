"""Rotary position embedding's table, precomputed, so a decode step only gathers rows of it (no
trigonometry on the host, nothing allocated per position: safe inside a CUDA graph). The rotation
itself is the kernel set's (`Model.rotate`: kernels/dense/rope.py, one launch on GPU)."""

from __future__ import annotations

import torch


class RopeTable:
    """cos/sin of every position in [0, max_positions) for `dim` rotary dims, in fp32."""

    def __init__(
        self, dim: int, max_positions: int, theta: float, device: torch.device | str = "cpu"
    ) -> None:
        if dim % 2 or dim <= 0 or max_positions <= 0:
            raise ValueError(
                f"rope dim must be even and positive, positions positive: {dim}, {max_positions}"
            )
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, dim/2] for positions [n]; out-of-range positions are clamped (padding
        rows carry arbitrary positions and must not index out of bounds)."""
        p = positions.clamp(0, self.max_positions - 1)
        return self.cos.index_select(0, p), self.sin.index_select(0, p)
