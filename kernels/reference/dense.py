"""References of the batch-invariant dense math (kernels/dense/): the same K walk and norms in
plain PyTorch, themselves batch-invariant on CPU.

Matmul: fp32 accumulation over ascending BLOCK_K steps, each step's dot in fp64 and rounded to
fp32 once, as kernels.dense.matmul does under the interpreter. Products of bf16 (or fp16) values
are exact in fp64 and a step's 64 of them sum exactly unless their magnitudes span more than
~2^40, so a step's value does not depend on how the BLAS blocks the call (on M). Norms: sums in
fp64 per row (exact for squares of bf16 values, hence in any order)."""

from __future__ import annotations

import torch

from kernels.tiles import GEMM_BLOCK_K as BLOCK_K


def ref_invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N] in a's dtype (kernels.dense.matmul.invariant_bmm)."""
    g, m, k = a.shape
    acc = torch.zeros((g, m, b.shape[2]), dtype=torch.float32, device=a.device)
    for k0 in range(0, k, BLOCK_K):
        step = torch.bmm(a[:, :, k0 : k0 + BLOCK_K].double(), b[:, k0 : k0 + BLOCK_K].double())
        acc += step.float()
    return acc.to(a.dtype)


def ref_invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias (kernels.dense.matmul.invariant_linear)."""
    out = ref_invariant_bmm(x.reshape(1, -1, x.shape[-1]), w.t()[None])
    return out.view(*x.shape[:-1], w.shape[0])


def _norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    d = x.shape[-1]
    if b is not None:
        xf = xf - (xf.double().sum(-1, keepdim=True) / d).float()
    ms = (xf.double().pow(2).sum(-1, keepdim=True) / d).float()
    y = xf * torch.rsqrt(ms + eps) * w.float()
    return (y if b is None else y + b.float()).to(x.dtype)


def ref_invariant_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.dense.row_norm.invariant_rms_norm."""
    return _norm(x, w, None, eps)


def ref_invariant_layer_norm(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
) -> torch.Tensor:
    """kernels.dense.row_norm.invariant_layer_norm."""
    return _norm(x, w, b, eps)
