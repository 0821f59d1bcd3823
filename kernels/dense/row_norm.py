"""Batch-invariant RMSNorm and LayerNorm: one program per row, the whole row in one block, so a
row's sums follow one fixed tree set by the row width alone. PyTorch's generic reduction (what
`x.pow(2).mean(-1)` runs on CUDA) shapes its thread blocks by the number of rows too, so its
per-row bits can change with M; F.layer_norm's CUDA kernel is one block per row already, but the
engine's batch-invariant mode sends both norms here so that no norm depends on a library's
dispatch."""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.interpreter import INTERPRETED
from kernels.tiles import bf16_nearest


@triton.jit
def _row_norm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    D,
    s_x,
    s_y,
    eps,
    BLOCK: tl.constexpr,
    CENTER: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + row * s_x + d, mask=ok, other=0.0).to(tl.float32)
    if CENTER:
        x = tl.where(ok, x - tl.sum(x, axis=0) / D, 0.0)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    y = y * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if CENTER:
        y = y + tl.load(b_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_nearest(y, UPCAST)
    tl.store(y_ptr + row * s_y + d, y.to(y_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    if w.shape != (d,) or (b is not None and b.shape != (d,)) or x.stride(-1) != 1:
        raise ValueError(f"norm: x [..., {d}] with unit last stride and weights [{d}]")
    x2 = x.reshape(-1, d)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    # Warps from the width alone (they shape the sums' tree), never from the row count.
    warps = 4 if block <= 2048 else 8
    if x2.shape[0]:
        _row_norm_kernel[(x2.shape[0],)](
            x2, w, w if b is None else b, y, d, x2.stride(0), y.stride(0), eps,
            BLOCK=block, CENTER=b is not None, UPCAST=INTERPRETED, num_warps=warps,
        )  # fmt: skip
    return y.view(x.shape)


def invariant_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, fp32 math, in x's dtype."""
    return _launch(x, w, None, eps)


def invariant_layer_norm(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
) -> torch.Tensor:
    """(x - mean) * rsqrt(var + eps) * w + b over the last dim, fp32 math, in x's dtype."""
    return _launch(x, w, b, eps)
