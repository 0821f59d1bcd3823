"""Tile helpers shared by the attention and indexer kernels (UPCAST: kernels.interpreter)."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

# The K step of the batch-invariant matmul (kernels/dense/matmul.py) and its reference: part of
# the output's bits (the fp32 accumulator rounds once per step), so one owner for both.
GEMM_BLOCK_K = 64


@triton.jit
def bf16_dot(a, b, acc, UPCAST: tl.constexpr):
    """tl.dot of bf16 (or fp8) tiles with fp32 accumulation; UPCAST under the interpreter."""
    if UPCAST:
        # Triton 3.9's interpreter multiplies the raw bits of bf16 operands; fp32 products of
        # bf16 values are exact, so upcasting keeps the GPU's numerics.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def exact_dot(a, b, acc, UPCAST: tl.constexpr):
    """bf16_dot for kernels whose bits must not depend on tile shapes. On GPU the tensor cores
    sum each element's products in the same order for any tile M and N. The interpreter's BLAS
    does not (its blocking follows the shapes), so there the products are summed in float64,
    where bf16 products are exact and the sum rounds to the same fp32 in any order."""
    if UPCAST:
        d = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
        if acc is None:
            return d
        else:
            return acc + d
    else:
        return tl.dot(a, b, acc)


@triton.jit
def staged_slot(ids, j, NB: tl.constexpr):
    """Row j of slots staged in registers ([NB, BLOCK] -> [BLOCK]) without a dynamic index: the
    gather addresses of a loop over j then come from no load of that loop, so Triton's
    pipeliner keeps num_stages - 1 tiles in flight (with a slot load in the loop it keeps one,
    and waits for it every step)."""
    return tl.sum(tl.where(tl.arange(0, NB)[:, None] == j, ids, 0), axis=0)


@triton.jit
def bf16_nearest(x, UPCAST: tl.constexpr):
    """fp32 x, to be stored as bf16, rounded to nearest even first under the interpreter:
    Triton 3.9's interpreter truncates fp32 -> bf16, the GPU's cast (and torch's) rounds to
    nearest. The bit trick leaves a value the truncating cast keeps exactly. GPU: x as is."""
    if UPCAST:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x
