"""References of the dense math (kernels/dense/): the batch-invariant K walk and norms in plain
PyTorch, themselves batch-invariant on CPU, the model's default RMSNorm (`ref_rms_norm`) and the
rotary embedding (`ref_rotate`).

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


def ref_rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels.dense.rope.rotate: x [n, (H,) r] rotated by cos/sin [n, r/2] in fp32, into out
    (new if None, x itself in place). interleaved: pairs (x0, x1), (x2, x3), ... as DeepSeek's
    MLA rope; otherwise the halves pair up, as V3.2's indexer rope."""
    n, half = cos.shape
    shape = (n,) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        y = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half:]
        y = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.dense.rms_norm.rms_norm: the model's default RMSNorm, fp32 math in PyTorch's
    reduction (whose summation tree follows the tensor's sizes, so it is not batch-invariant)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
