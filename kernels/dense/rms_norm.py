"""RMSNorm with PyTorch's bits in fewer passes: what the model's default norm computes
(kernels.reference.dense.ref_rms_norm: `xf * rsqrt(mean(xf^2) + eps) * w` in fp32), with the two
elementwise ends fused.

Why: the PyTorch expression is ~9 launches over [n, D] (an upcast, a square, the mean, + eps,
rsqrt, two products, the weight's upcast, a downcast), four times a layer and once at the end:
run AF charged the norms 0.56 ms of the 14.3 ms fp8 step at N 222. Here: one kernel writes xf^2
(fp32), PyTorch's own reduction takes its mean (so each row's summation tree, which PyTorch
shapes by the tensor's sizes, is the one the expression had: the same fp32 input of the same
shape), PyTorch adds eps and takes rsqrt on [n, 1], and one kernel writes (xf * r) * w rounded to
x's dtype. Products only, no sums in the kernels: no fused multiply-add can change a bit, and the
bf16 store rounds to nearest even like PyTorch's cast (kernels.tiles.bf16_nearest under the
interpreter).

A fused one-pass norm (kernels.dense.row_norm) sums in its own order: the batch-invariant mode's
choice, not the default's.
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.interpreter import INTERPRETED
from kernels.tiles import bf16_nearest


@triton.jit
def _rms_square_kernel(x_ptr, sq_ptr, D, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + row * s_x + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(sq_ptr + row * D + d, x * x, mask=ok)


@triton.jit
def _rms_scale_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, D, s_x, BLOCK: tl.constexpr, UPCAST: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + row * s_x + d, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    y = (x * tl.load(r_ptr + row)) * w
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_nearest(y, UPCAST)
    tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=ok)


_BLOCK = 1024


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, D] (unit last stride; rows may be strided) normed over D with weights w [D]: a new
    contiguous tensor of x's dtype, equal bit for bit to ref_rms_norm's."""
    if x.dim() != 2 or x.stride(-1) != 1 or w.shape != (x.shape[-1],) or w.device != x.device:
        raise ValueError(f"rms_norm: x [n, D] with unit last stride, w [D]: {x.shape}, {w.shape}")
    n, d = x.shape
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    sq = torch.empty((n, d), dtype=torch.float32, device=x.device)
    grid = (n, triton.cdiv(d, _BLOCK))
    _rms_square_kernel[grid](x, sq, d, x.stride(0), BLOCK=_BLOCK, enable_fp_fusion=False)
    # PyTorch's reduction, add and rsqrt: the reference's own ops on the reference's operands.
    r = torch.rsqrt(sq.mean(-1, keepdim=True) + eps)
    _rms_scale_kernel[grid](
        x, r, w, y, d, x.stride(0), BLOCK=_BLOCK, UPCAST=INTERPRETED, enable_fp_fusion=False
    )
    return y
