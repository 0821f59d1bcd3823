"""Rotary position embedding in one launch: rows [n, H, r] (any strides but a unit last one)
rotated by their position's cos/sin [n, r / 2] into an output of the same shape, in place when
the output is the input.

Why a kernel: the PyTorch expression (kernels.reference.dense.ref_rotate: an fp32 upcast, two
slices, four products, a sum, a difference, a stack or cat, a downcast) is ~8 launches a call and
the model makes four calls a layer (q_pe, the KV row's k_pe, the indexer's query and key): run AF
charged "rope" 0.40 ms of the 14.3 ms fp8 step at N 222 (bench.profile, 4 layers), launch-bound.

Bits: the reference's, exactly. Each output is one fp32 product pair rounded twice and combined
(a c - b s, a s + b c), so the launch turns off fp contraction (`enable_fp_fusion=False`): a
fused multiply-add would round once and differ from PyTorch's separate kernels in the last bit.
The bf16 store rounds to nearest even like PyTorch's cast (kernels.tiles.bf16_nearest under the
interpreter, whose cast truncates).
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.interpreter import INTERPRETED
from kernels.tiles import bf16_nearest

_HEADS_PER_PROGRAM = 16


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    H,
    s_xn,
    s_xh,
    s_yn,
    s_yh,
    s_c,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    j = tl.arange(0, HALF)[None, :]
    ok = h < H
    # Pairs: (2j, 2j + 1) interleaved (MLA's rope), (j, j + HALF) split (V3.2's indexer rope).
    if INTERLEAVED:
        ia, ib = 2 * j, 2 * j + 1
    else:
        ia, ib = j, j + HALF
    c = tl.load(cos_ptr + n * s_c + j)
    s = tl.load(sin_ptr + n * s_c + j)
    x = x_ptr + n * s_xn + h * s_xh
    a = tl.load(x + ia, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(x + ib, mask=ok, other=0.0).to(tl.float32)
    ya, yb = a * c - b * s, a * s + b * c
    if y_ptr.dtype.element_ty == tl.bfloat16:
        ya, yb = bf16_nearest(ya, UPCAST), bf16_nearest(yb, UPCAST)
    y = y_ptr + n * s_yn + h * s_yh
    tl.store(y + ia, ya.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(y + ib, yb.to(y_ptr.dtype.element_ty), mask=ok)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[n, r] as [n, 1, r] (a view: the strides stay)."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, r] or [n, H, r] rotated by cos, sin [n, r / 2] (fp32) into out (a new contiguous
    tensor of x's shape and dtype if None; x itself rotates in place). interleaved: pairs
    (x0, x1), (x2, x3), ...; else the halves pair up. Returns out."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    _check(x, cos, sin, y)
    x3, y3 = _heads(x), _heads(y)
    n, h, r = x3.shape
    if n and h:
        grid = (n, triton.cdiv(h, _HEADS_PER_PROGRAM))
        _rope_kernel[grid](
            x3, cos, sin, y3, h, x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1),
            cos.stride(0), HALF=r // 2, BLOCK_H=min(_HEADS_PER_PROGRAM, triton.next_power_of_2(h)),
            INTERLEAVED=interleaved, UPCAST=INTERPRETED, enable_fp_fusion=False,
        )  # fmt: skip
    return y


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor) -> None:
    r = x.shape[-1]
    if x.dim() not in (2, 3) or r % 2 or r & (r - 1) or x.stride(-1) != 1:
        raise ValueError(f"rope: x [n, (H,) r] with r a power of two, unit last stride: {x.shape}")
    want = (x.shape[0], r // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != want or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"rope: {name} must be fp32 {list(want)}, got {t.dtype} {t.shape}")
    if cos.stride() != sin.stride():
        raise ValueError("rope: cos and sin must share their strides")
    if y.shape != x.shape or y.dtype != x.dtype or y.stride(-1) != 1 or y.device != x.device:
        raise ValueError(f"rope: out must be {x.dtype} {list(x.shape)}, unit last stride")
