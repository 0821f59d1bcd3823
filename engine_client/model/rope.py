"""Rotary position embedding with a precomputed table, so a decode step only gathers rows of it
(no trigonometry on the host, nothing allocated per position: safe inside a CUDA graph)."""

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


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate x [n, ..., dim] by cos/sin [n, dim/2]; computed in fp32, returned in x.dtype.

    interleaved: pairs are (x0, x1), (x2, x3), ... as DeepSeek's MLA rope; otherwise the halves
    (x[:dim/2], x[dim/2:]) pair up, as V3.2's indexer rope."""
    n, half = cos.shape
    shape = (n,) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(x.dtype)
