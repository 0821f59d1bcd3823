"""Gathered KV rows as bf16 tensor-core tiles, and one tile's attention scores.

Rows are bf16 [n, 576], or DeepSeek-V3.2's fp8 rows (656 B, kernels/store/fp8_row.py),
dequantized here.

Triton's own e4m3 -> bf16 cast costs three conversion instructions per pair of values, on the
slow conversion pipe: FlashMLA's fp8 deep dive finds dequantization, not the tensor cores, the
limit of a Hopper decode kernel. Here it is integer work instead (GPU): each e4m3 byte is placed
in the bits of a bf16, which then reads as value * 2^-120 (zero and subnormals too), and one
packed bf16 multiply by scale * 2^64 gives value * scale * 2^-56. Every step is exact (the
scales are powers of two), so a kernel that multiplies its fp32 dot results by 2^56 gets the bits
of the plain dequantized rows. Under the interpreter the rows dequantize through fp32, exactly.

Rows from the host tier (HOST_ROWS, see host_row_starts): the loaders then take each row's start
in kv elements instead of its row index, so one kv pointer reaches both the hot buffer and the
pinned host tier. With HOST_ROWS off every loader emits what it did before the option existed.
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

# The fp8 row's geometry as compile-time constants (bytes, fp32 words, bf16 halves, where scales
# and rope start, values per scale): kernels.store.fp8_row derives them from kernels.formats, once.
from kernels.store.fp8_row import _BLOCK, _ROPE_AT, _ROW, _ROW_HALVES, _ROW_WORDS, _SCALES_AT
from kernels.tiles import exact_dot

# The factor fast dequantization leaves on latent values (2^-56); exact in fp32 and bf16.
FAST_SHIFT = tl.constexpr(2.0**-56)
_E4M3_BITS = tl.constexpr(
    """
{
.reg .b32 a<2>, b<2>;
prmt.b32 a0, 0, $2, 0x5140;
prmt.b32 a1, 0, $2, 0x7362;
and.b32 b0, a0, 0x7fff7fff;
and.b32 b1, a1, 0x7fff7fff;
shr.b32 b0, b0, 4;
shr.b32 b1, b1, 4;
lop3.b32 $0, b0, 0x80008000, a0, 0xf8;
lop3.b32 $1, b1, 0x80008000, a1, 0xf8;
}
"""
)


@triton.jit
def e4m3_as_bf16(codes):
    """uint8 e4m3 codes -> bf16 holding value * 2^-120, by bit placement (GPU only): the byte
    goes to the high byte of a 16-bit lane, the sign stays, exponent and mantissa shift right
    by 4 into bf16's fields. Zero and subnormal codes land on the same scaled values."""
    return tl.inline_asm_elementwise(
        _E4M3_BITS, "=r,=r,r", [codes], dtype=tl.bfloat16, is_pure=True, pack=4
    )


@triton.jit
def host_row_starts(slot, base, host_off, s_kv, ROW_FP8: tl.constexpr):
    """(row starts in kv elements, valid) of slot-list entries for the HOST_ROWS loaders: slot
    >= 0 is kv's row base + slot, -1 no row, <= -2 the host tier's row -2 - slot (the tier
    starts host_off kv elements from kv_ptr, either sign). Without HOST_ROWS the callers keep
    row indices (base + slot, valid slot >= 0), as before. A host row past the tier's end is
    the caller's contract violation: nothing here bounds it."""
    s = slot.to(tl.int64)
    start = tl.where(s < -1, host_off + (-2 - s) * s_kv, (base + s) * s_kv)
    # sparse_mla_decode checks both bases and the row stride are 16-byte multiples: the gathers
    # keep their 16-byte vectors (Triton cannot see it through the select).
    if ROW_FP8:
        start = tl.multiple_of(start, 16)
    else:
        start = tl.multiple_of(start, 8)
    return start, slot != -1


@triton.jit
def slot_rows(slot, base, host_off, s_kv, ROW_FP8: tl.constexpr, HOST_ROWS: tl.constexpr):
    """(rows, valid) of slot-list entries as the loaders take them: host_row_starts' row starts
    with HOST_ROWS, else row indices base + slot, valid where slot >= 0."""
    if HOST_ROWS:
        return host_row_starts(slot, base, host_off, s_kv, ROW_FP8)
    else:
        valid = slot >= 0
        return base + slot.to(tl.int64), valid


@triton.jit
def load_latent(
    kv_ptr,
    row,
    valid,
    col0,
    NBLK: tl.constexpr,
    W: tl.constexpr,
    FAST: tl.constexpr,
    HOST_ROWS: tl.constexpr = False,
):
    """Latent columns [col0, col0 + NBLK * W) of fp8 rows `row` as bf16 [N, NBLK * W]; W divides
    the 128 values of a scale block and col0 is a multiple of W. FAST: value * scale * 2^-56
    (see module doc); else exact value * scale (the interpreter's fp32 path). HOST_ROWS: row
    holds row starts in bytes (host_row_starts)."""
    codes, s = load_latent_codes(kv_ptr, row, valid, col0, NBLK, W, HOST_ROWS)
    return dequant_latent(codes, s, FAST)


@triton.jit
def load_latent_codes(
    kv_ptr, row, valid, col0, NBLK: tl.constexpr, W: tl.constexpr, HOST_ROWS: tl.constexpr
):
    """load_latent's loads alone: (e4m3 codes uint8 [N, NBLK, W], scales fp32 [N, NBLK]), so a
    kernel can issue the next tile's gathers before it dequantizes this one."""
    blk = tl.arange(0, NBLK)
    cols = col0 + blk[:, None] * W + tl.arange(0, W)[None, :]
    # Each branch keeps its address inside tl.load: the no-host branch is then, op for op, the
    # code from before HOST_ROWS (the op order reaches ptxas's schedule).
    if HOST_ROWS:
        codes = tl.load(
            kv_ptr + row[:, None, None] + cols[None, :, :], mask=valid[:, None, None], other=0
        )
    else:
        codes = tl.load(
            kv_ptr + row[:, None, None] * _ROW + cols[None, :, :],
            mask=valid[:, None, None],
            other=0,
        )
    scale_ptr = (kv_ptr + _SCALES_AT).to(tl.pointer_type(tl.float32), bitcast=True)
    sblk = col0 // _BLOCK + blk
    if HOST_ROWS:
        # Row starts are 16-byte multiples: exact in fp32 words (truncation is floor here).
        s = tl.load(scale_ptr + (row // 4)[:, None] + sblk[None, :], mask=valid[:, None], other=0.0)
    else:
        s = tl.load(
            scale_ptr + row[:, None] * _ROW_WORDS + sblk[None, :], mask=valid[:, None], other=0.0
        )
    return codes, s


@triton.jit
def dequant_latent(codes, s, FAST: tl.constexpr):
    """bf16 [N, NBLK * W] of load_latent_codes' codes and scales (load_latent's numerics)."""
    if FAST:
        lat = e4m3_as_bf16(codes) * (s * 18446744073709551616.0).to(tl.bfloat16)[:, :, None]
    else:
        lat = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, :, None]).to(tl.bfloat16)
    return tl.reshape(lat, [codes.shape[0], codes.shape[1] * codes.shape[2]])


@triton.jit
def load_rope(kv_ptr, row, valid, D_PE: tl.constexpr, HOST_ROWS: tl.constexpr = False):
    rope_ptr = (kv_ptr + _ROPE_AT).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if HOST_ROWS:
        return tl.load(  # row starts in bytes, even: bf16 halves
            rope_ptr + (row // 2)[:, None] + tl.arange(0, D_PE)[None, :],
            mask=valid[:, None],
            other=0.0,
        )
    else:
        return tl.load(
            rope_ptr + row[:, None] * _ROW_HALVES + tl.arange(0, D_PE)[None, :],
            mask=valid[:, None],
            other=0.0,
        )


@triton.jit
def load_kv_tile(
    kv_ptr,
    row,
    valid,
    s_kv,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr = False,
):
    """(latent [N, D_V], rope [N, D_PE]) bf16 of rows `row` (starts with HOST_ROWS); invalid rows
    are never read (0). fp8 latents carry the 2^-56 of fast dequantization on GPU (tile_scores)."""
    lat, s, k_pe = load_kv_bytes(kv_ptr, row, valid, s_kv, D_V, D_PE, ROW_FP8, HOST_ROWS)
    return kv_tile_of(lat, s, k_pe, UPCAST, ROW_FP8)


@triton.jit
def load_kv_bytes(
    kv_ptr,
    row,
    valid,
    s_kv,
    D_V: tl.constexpr,
    D_PE: tl.constexpr,
    ROW_FP8: tl.constexpr,
    HOST_ROWS: tl.constexpr,
):
    """load_kv_tile's loads alone, for kernels that gather a tile ahead of its use:
    (latent, scales, rope) as loaded. fp8: codes [N, 4, 128] uint8, scales [N, 4] fp32; bf16
    rows: the latent itself and an unused scale placeholder. kv_tile_of finishes the tile."""
    if ROW_FP8:
        lat, s = load_latent_codes(kv_ptr, row, valid, 0, D_V // _BLOCK, _BLOCK, HOST_ROWS)
        k_pe = load_rope(kv_ptr, row, valid, D_PE, HOST_ROWS)
    else:
        if HOST_ROWS:
            row_ptr = kv_ptr + row
        else:
            row_ptr = kv_ptr + row * s_kv
        lat = tl.load(row_ptr[:, None] + tl.arange(0, D_V)[None, :], mask=valid[:, None], other=0.0)
        k_pe = tl.load(
            row_ptr[:, None] + D_V + tl.arange(0, D_PE)[None, :], mask=valid[:, None], other=0.0
        )
        s = tl.zeros([1], tl.float32)
    return lat, s, k_pe


@triton.jit
def kv_tile_of(lat, s, k_pe, UPCAST: tl.constexpr, ROW_FP8: tl.constexpr):
    """(latent, rope) bf16 of load_kv_bytes' loads: fp8 codes dequantized (load_kv_tile)."""
    if ROW_FP8:
        return dequant_latent(lat, s, not UPCAST), k_pe
    else:
        return lat, k_pe


@triton.jit
def tile_scores(q_nope, q_pe, k_nope, k_pe, UPCAST: tl.constexpr, ROW_FP8: tl.constexpr):
    """Raw scores [heads, N] (fp32) of one tile from load_kv_tile: the latent dot gets its 2^56
    back (exact) before the rope dot accumulates onto it."""
    s = exact_dot(q_nope, tl.trans(k_nope), None, UPCAST)
    if ROW_FP8 and not UPCAST:
        s = s * (1.0 / FAST_SHIFT)
    return exact_dot(q_pe, tl.trans(k_pe), s, UPCAST)
