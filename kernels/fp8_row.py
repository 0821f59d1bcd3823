"""DeepSeek-V3.2's fp8 KV row (FlashMLA's 656 B format) inside Triton kernels.

Bytes of a row: [0, 512) the 512 latent values as fp8 e4m3, [512, 528) four fp32 scales (one per
128 latent values), [528, 656) the 64 rope values as bf16, unquantized. Quantization (the rule is
`kernels.reference.fp8_block_scales` / `ref_quantize_kv_rows`): per 128-value block, scale is the
smallest power of two with max|x| / scale <= 448 (max|x| floored at 1e-4); the fp8 value is
x / scale rounded to nearest even. Powers of two keep x / scale and fp8 * scale exact, so the
kernels, the torch reference and every KV mode produce the same bytes and the same bf16 values.

The fp32 -> e4m3 rounding is done with integer ops, not Triton's fp8 cast: Triton 3.9's
interpreter drops the carry when a mantissa rounds up into the next binade (126.6 -> 64).
Reading rows as tensor-core tiles lives in kernels/kv_tiles.py (integer dequantization on GPU,
fp32 under the interpreter, whose bf16 arithmetic is not usable), exact both ways.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_ROW_BYTES

ROWS_PER_PROGRAM = 4


@triton.jit
def fp8_block_scales(amax):
    """(scale, 1 / scale) fp32 powers of two for block maxima amax (>= 0)."""
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    # amax = m * 2^e with m in [1, 2): amax / 448 = (m / 1.75) * 2^(e - 8).
    s = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return ((s + 127) << 23).to(tl.float32, bitcast=True), ((127 - s) << 23).to(
        tl.float32, bitcast=True
    )


@triton.jit
def e4m3_code(v):
    """fp32 -> fp8 e4m3fn bits (int32 in [0, 256)), clamped to +-448, rounded to nearest even."""
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): round the fp32 mantissa to 3 bits; a carry moves the exponent.
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    normal = r - (120 << 3)
    # Subnormals are multiples of 2^-9: one fp32 add rounds a * 2^9 to an integer (nearest
    # even), which then sits in the low mantissa bits of 2^23 + n.
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(a < 0.015625, sub, normal) | sign


@triton.jit
def quantize_rows(src_ptr, rows, ok):
    """Rows `rows` of a bf16 [n, 576] tensor -> (codes [R, 4, 128] uint8, scales [R, 4] fp32,
    rope [R, 64] bf16)."""
    c = tl.arange(0, 4)
    d = tl.arange(0, 128)
    x = tl.load(
        src_ptr + rows[:, None, None] * 576 + c[None, :, None] * 128 + d[None, None, :],
        mask=ok[:, None, None],
        other=0.0,
    ).to(tl.float32)
    scale, inv = fp8_block_scales(tl.max(tl.abs(x), axis=2))
    codes = e4m3_code(x * inv[:, :, None]).to(tl.uint8)
    rope = tl.load(
        src_ptr + rows[:, None] * 576 + 512 + tl.arange(0, 64)[None, :], mask=ok[:, None], other=0.0
    )
    return codes, scale, rope


@triton.jit
def store_fp8_rows(base_ptr, rows, mask, codes, scale, rope):
    """Store quantized rows at row numbers `rows` (int64) of a uint8 [n, 656] tensor."""
    c = tl.arange(0, 4)
    d = tl.arange(0, 128)
    tl.store(
        base_ptr + rows[:, None, None] * 656 + c[None, :, None] * 128 + d[None, None, :],
        codes,
        mask=mask[:, None, None],
    )
    scale_ptr = (base_ptr + 512).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptr + rows[:, None] * 164 + c[None, :], scale, mask=mask[:, None])
    rope_ptr = (base_ptr + 528).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    tl.store(rope_ptr + rows[:, None] * 328 + tl.arange(0, 64)[None, :], rope, mask=mask[:, None])


@triton.jit
def _quantize_kernel(src_ptr, dst_ptr, n, ROWS: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = i < n
    rows = i.to(tl.int64)
    codes, scale, rope = quantize_rows(src_ptr, rows, ok)
    store_fp8_rows(
        dst_ptr.to(tl.pointer_type(tl.uint8), bitcast=True), rows, ok, codes, scale, rope
    )


def kv_quantize(rows: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize rows [n, 576] bf16 into fp8 rows out [n, 656] uint8 (both contiguous): the
    same bytes kv_append writes. Launch-only: graph capturable."""
    n = rows.shape[0]
    if rows.dtype != torch.bfloat16 or tuple(rows.shape) != (n, 576) or not rows.is_contiguous():
        raise ValueError(
            f"rows: expected contiguous [n, 576] bf16, got {tuple(rows.shape)} {rows.dtype}"
        )
    if (
        out.dtype != torch.uint8
        or tuple(out.shape) != (n, FP8_ROW_BYTES)
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out: expected contiguous [{n}, {FP8_ROW_BYTES}] uint8, got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    if n == 0:
        return
    _quantize_kernel[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
        rows, out, n, ROWS=ROWS_PER_PROGRAM, num_warps=4
    )
