"""Batch-invariant matmul: each output row's bits depend on its own input row and the weights,
never on how many rows the call has (Thinking Machines, "Defeating Nondeterminism in LLM
Inference": cuBLAS picks kernels and split-K by M, so a verify step's row 0 and a plain decode
row round differently).

The recipe: one tile shape chosen from (N, K) alone, never M; no split-K (one program owns an
output tile and walks K from 0 upwards in BLOCK_K steps, accumulating in fp32); no atomics. On
GPU the tensor cores sum a dot's products in the same order for any tile position, so the row's
bits are those of the same K walk whatever M is. Under the interpreter each BLOCK_K step is an
fp64 dot (kernels.tiles.exact_dot), exactly what kernels.reference.dense computes.
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.interpreter import INTERPRETED
from kernels.tiles import GEMM_BLOCK_K as BLOCK_K
from kernels.tiles import bf16_nearest, exact_dot

# bf16 and fp16 only: an fp32 tl.dot would run in tf32 on GPU, unlike the reference.
_DTYPES = (torch.bfloat16, torch.float16)


# M is not specialized: Triton would otherwise compile another kernel for M == 1 or M % 16 == 0.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    s_ab,
    s_am,
    s_ak,
    s_bb,
    s_bk,
    s_bn,
    s_cb,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(2).to(tl.int64)
    a_rows = a_ptr + g * s_ab + rm.to(tl.int64)[:, None] * s_am
    b_cols = b_ptr + g * s_bb + rn.to(tl.int64)[None, :] * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Ascending K, one fixed step: the only reduction order a row's result ever sees.
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        a = tl.load(a_rows + rk[None, :] * s_ak, mask=(rm < M)[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_cols + rk[:, None] * s_bk, mask=in_k[:, None] & (rn < N)[None, :], other=0.0)
        acc = exact_dot(a, b, acc, UPCAST)
    c = c_ptr + g * s_cb + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    if c_ptr.dtype.element_ty == tl.bfloat16:
        acc = bf16_nearest(acc, UPCAST)
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def tiles_for(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) from the output width alone, never M: narrow outputs get
    narrow tiles so that more programs stream the weight (no split-K may help them)."""
    return (64, 32, 4) if n <= 4096 else (64, 64, 4)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(
            f"matmul: expected a [G, M, K] and b [G, K, N], got {tuple(a.shape)} {tuple(b.shape)}"
        )
    if a.dtype != b.dtype or a.dtype not in _DTYPES or a.device != b.device:
        raise ValueError(f"matmul: a and b must share a dtype of {_DTYPES} and a device")


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N] in a's dtype, any strides, fp32 accumulation;
    row m of each output depends on row m of a and on b only (the module doc)."""
    _check(a, b)
    g, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((g, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    bm, bn, warps = tiles_for(n)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), g)
    # Strides: the -2/-1 of a view such as w.t() may be anything; the kernel takes them all.
    _matmul_kernel[grid](
        a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, UPCAST=INTERPRETED, num_warps=warps,
    )  # fmt: skip
    return c


def invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias, batch-invariant: x [..., K], w [N, K] -> [..., N]."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x [..., {w.shape[-1]}] and w [N, K], got {tuple(x.shape)}")
    lead = x.shape[:-1]
    out = invariant_bmm(x.reshape(1, -1, x.shape[-1]), w.t()[None])
    return out.view(*lead, w.shape[0])
