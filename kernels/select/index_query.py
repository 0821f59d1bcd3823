"""The lightning indexer's query in the precision of its dot with the keys
(kernels/select/indexer.py): fp8 keys are scored either against an f16 copy of q (keys converted
to f16) or, as V3.2's own indexer does, against q cast to e4m3 (keys used as stored). Either
way q is scaled by a power of two first, exactly, and the scale comes back through the weights."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl


@triton.jit
def f16_query(q):
    """q as f16 times 2^-e, and 2^e: e puts max |q| near 2^15, so every bf16 value of q that
    matters converts exactly (power-of-two scaling is exact; values below 2^-39 max |q| flush)."""
    amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
    # The floor keeps log2 finite for q = 0 (then 2^e is tiny, never an inf weight).
    e = tl.ceil(tl.math.log2(tl.maximum(amax, 1.1754943508222875e-38))).to(tl.int32) - 15
    e = tl.minimum(tl.maximum(e, -100), 100)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * down).to(tl.float16), up


@triton.jit
def fp8_query(q, UPCAST: tl.constexpr):
    """q as e4m3 per head times 2^-e_h, and 2^e_h [heads]: e_h the least integer with
    max |q_h| * 2^-e_h <= 448 (e4m3's largest), read off the float's bits (no log2, whose GPU
    approximation could miss a boundary), so the scaling is exact and only the cast to e4m3
    rounds (to nearest even), as V3.2's own fp8 indexer quantizes its query. For
    amax = m * 2^E (1 <= m < 2): amax / 448 = (m / 1.75) * 2^(E - 8), so e = E - 8, plus 1
    where m > 1.75. A head of zeros gets a finite e (its products are 0). UPCAST (the
    interpreter): the e4m3 values as fp32, rounded by e4m3_nearest (Triton 3.9's interpreter
    drops the carry when rounding into the next binade: -127 became -64, not -128)."""
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    bits = tl.maximum(amax, 1.1754943508222875e-38).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)
    scaled = q.to(tl.float32) * down[:, None]
    if UPCAST:
        return e4m3_nearest(scaled), up
    else:
        return scaled.to(tl.float8e4nv), up


@triton.jit
def e4m3_nearest(x):
    """fp32 x (|x| <= 448) rounded to e4m3's grid, to nearest even, as fp32: adding and taking
    away 1.5 * 2^(E + 20) leaves x rounded to 2^(E - 3), e4m3's step in x's binade 2^E (3
    mantissa bits; the subnormals below 2^-6 share 2^-9), carries into the next binade included."""
    bits = x.to(tl.int32, bitcast=True)
    binade = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    c = ((binade + 147) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (tl.abs(x) + c) - c
    return tl.where(x < 0, -r, r)
