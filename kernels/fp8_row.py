"""DeepSeek-V3.2's fp8 KV row (FlashMLA's 656 B format) inside Triton kernels.

Bytes of a row: [0, 512) the 512 latent values as fp8 e4m3, [512, 528) four fp32 scales (one per
128 latent values), [528, 656) the 64 rope values as bf16, unquantized. Quantization (the rule is
`kernels.formats.fp8_block_scales` / `quantize_fp8_rows`): per 128-value block, scale is the
smallest power of two with max|x| / scale <= 448 (max|x| floored at 1e-4); the fp8 value is
x / scale rounded to nearest even. Powers of two keep x / scale and fp8 * scale exact, so the
kernels, the torch reference and every KV mode produce the same bytes and the same bf16 values.

Every size and offset comes from `kernels.formats` (FP8_ROW), the format's owner.

The fp32 -> e4m3 rounding is done with integer ops, not Triton's fp8 cast: Triton 3.9's
interpreter drops the carry when a mantissa rounds up into the next binade (126.6 -> 64).
Reading rows as tensor-core tiles lives in kernels/kv_tiles.py (integer dequantization on GPU,
fp32 under the interpreter, whose bf16 arithmetic is not usable), exact both ways.
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.formats import (
    FP8_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_BLOCKS,
    FP8_MAX,
    FP8_ROPE_AT,
    FP8_ROW,
    FP8_SCALES_AT,
    LATENT_DIM,
    ROPE_DIM,
    ROW_VALUES,
    RowFormat,
    RowKernel,
)

ROWS_PER_PROGRAM = 4
# The row's geometry as compile-time constants of the kernels below: in bytes, fp32 words
# (scales) and bf16 halves (rope), and the bf16 source rows' width.
_ROW = tl.constexpr(FP8_ROW.row_bytes)
_ROW_WORDS = tl.constexpr(FP8_ROW.row_bytes // 4)
_ROW_HALVES = tl.constexpr(FP8_ROW.row_bytes // 2)
_SCALES_AT = tl.constexpr(FP8_SCALES_AT)
_ROPE_AT = tl.constexpr(FP8_ROPE_AT)
_BLOCKS = tl.constexpr(FP8_BLOCKS)
_BLOCK = tl.constexpr(FP8_BLOCK)
_LATENT = tl.constexpr(LATENT_DIM)
_ROPE = tl.constexpr(ROPE_DIM)
_SRC = tl.constexpr(ROW_VALUES)
_MAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def fp8_block_scales(amax):
    """(scale, 1 / scale) fp32 powers of two for block maxima amax (>= 0)."""
    bits = tl.maximum(amax, _FLOOR).to(tl.int32, bitcast=True)
    # amax = m * 2^e with m in [1, 2): amax / 448 = (m / 1.75) * 2^(e - 8).
    s = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return ((s + 127) << 23).to(tl.float32, bitcast=True), ((127 - s) << 23).to(
        tl.float32, bitcast=True
    )


@triton.jit
def e4m3_code(v):
    """fp32 -> fp8 e4m3fn bits (int32 in [0, 256)), clamped to +-448, rounded to nearest even."""
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(v), _MAX)
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
    c = tl.arange(0, _BLOCKS)
    d = tl.arange(0, _BLOCK)
    x = tl.load(
        src_ptr + rows[:, None, None] * _SRC + c[None, :, None] * _BLOCK + d[None, None, :],
        mask=ok[:, None, None],
        other=0.0,
    ).to(tl.float32)
    scale, inv = fp8_block_scales(tl.max(tl.abs(x), axis=2))
    codes = e4m3_code(x * inv[:, :, None]).to(tl.uint8)
    rope = tl.load(
        src_ptr + rows[:, None] * _SRC + _LATENT + tl.arange(0, _ROPE)[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    return codes, scale, rope


@triton.jit
def store_fp8_rows(base_ptr, rows, mask, codes, scale, rope):
    """Store quantized rows at row numbers `rows` (int64) of a uint8 [n, 656] tensor."""
    c = tl.arange(0, _BLOCKS)
    d = tl.arange(0, _BLOCK)
    tl.store(
        base_ptr + rows[:, None, None] * _ROW + c[None, :, None] * _BLOCK + d[None, None, :],
        codes,
        mask=mask[:, None, None],
    )
    scale_ptr = (base_ptr + _SCALES_AT).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptr + rows[:, None] * _ROW_WORDS + c[None, :], scale, mask=mask[:, None])
    rope_ptr = (base_ptr + _ROPE_AT).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    rope_at = rows[:, None] * _ROW_HALVES + tl.arange(0, _ROPE)[None, :]
    tl.store(rope_ptr + rope_at, rope, mask=mask[:, None])


@triton.jit
def _quantize_kernel(src_ptr, dst_ptr, n, ROWS: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = i < n
    rows = i.to(tl.int64)
    codes, scale, rope = quantize_rows(src_ptr, rows, ok)
    store_fp8_rows(
        dst_ptr.to(tl.pointer_type(tl.uint8), bitcast=True), rows, ok, codes, scale, rope
    )


def kv_quantize(rows: torch.Tensor, out: torch.Tensor, *, row_format: RowFormat = FP8_ROW) -> None:
    """Quantize rows [n, 576] bf16 into fp8 rows out [n, 656] uint8 (both contiguous): the
    same bytes kv_append writes. Launch-only: graph capturable."""
    if row_format.kernel is not RowKernel.FP8:
        raise ValueError(f"kv_quantize writes fp8 rows, not {row_format.name} rows")
    n = rows.shape[0]
    if (
        rows.dtype != torch.bfloat16
        or tuple(rows.shape) != (n, ROW_VALUES)
        or not rows.is_contiguous()
    ):
        raise ValueError(
            f"rows: expected contiguous [n, {ROW_VALUES}] bf16, "
            f"got {tuple(rows.shape)} {rows.dtype}"
        )
    if (
        out.dtype != torch.uint8
        or tuple(out.shape) != (n, row_format.row_bytes)
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out: expected contiguous [{n}, {row_format.row_bytes}] uint8, got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    if n == 0:
        return
    _quantize_kernel[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
        rows, out, n, ROWS=ROWS_PER_PROGRAM, num_warps=4
    )
