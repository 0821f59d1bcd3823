"""The replayed top-k trace (bench/shared/trace.py) as one Triton launch per layer.

The trace is benchmark input, not the product's work, yet written as ~25 elementwise torch ops on
[n, k] int64 tensors it cost the fp8 step 1.43 ms of 15.46 at N 222 (run V1's profile, "trace
top-k (bench input)"): 9% of the service's step and a smaller share of the baseline's (fewer
requests), so it pulled the measured service/baseline ratio down. Fused, each layer's trace reads
its [k] lane constants and writes the [n, k] int32 selection once.

Same integers as `TraceTopk`'s torch path (the reference; tests/bench/test_trace.py compares the
two on irregular shapes): every product stays below 2^63 (a 32-bit value times a multiplier
below 2^31), so int64 arithmetic is exact here as there.
"""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _mix(x):
    """bench/shared/trace.py's _mix: a 32-bit integer hash on int64 values."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _trace_kernel(
    key_ptr,
    phase_ptr,
    moving_ptr,
    slots_ptr,
    lens_ptr,
    out_ptr,
    K,
    s_out,
    EPOCH: tl.constexpr,
    FLICKER: tl.constexpr,
    ALTERNATES: tl.constexpr,
    PER_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    lanes = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lmask = lanes < K
    lens = tl.maximum(tl.load(lens_ptr + r).to(tl.int64), 1)
    t = lens - 1
    ratio = tl.maximum(lens // K, 1)
    # The largest power of two <= ratio (ratio < 2^31: 31 doublings at most).
    w = ratio * 0 + 1
    for _ in tl.static_range(31):
        w = tl.where(w * 2 <= ratio, w * 2, w)
    if PER_SLOT:
        slot = tl.maximum(tl.load(slots_ptr + r).to(tl.int64), 0)
    else:
        slot = lens * 0  # every request selects alike (TraceParams.per_slot)
    key = tl.load(key_ptr + lanes, mask=lmask, other=0)
    base = _mix(key + slot * 0x61C88647)
    moving = tl.load(moving_ptr + lanes, mask=lmask, other=0) != 0
    phase = tl.load(phase_ptr + lanes, mask=lmask, other=0)
    epoch = tl.where(moving, (t + phase) // EPOCH, 0)
    draw = _mix(base + t * 0x27D4EB2F)
    off_step = (draw & 0xFFFF) < FLICKER
    alt = 1 + (draw >> 16) % ALTERNATES
    which = tl.where(moving & off_step, alt, 0)
    h = _mix(base + epoch * 0x165667B1)
    stride = 1 + (h >> 8) % tl.maximum((w - 1) // ALTERNATES, 1)
    pos = lanes.to(tl.int64) * w + (h + which * stride) % w
    tl.store(out_ptr + r * s_out + lanes, tl.where(pos < lens, pos, -1), mask=lmask)


def _check(
    key: torch.Tensor,
    phase: torch.Tensor,
    moving: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """trace_topk's arguments: shapes, dtypes and the row layout it writes."""
    n, k = out.shape
    if key.shape != (k,) or phase.shape != (k,) or moving.shape != (k,):
        raise ValueError(f"lane constants {key.shape}, {phase.shape}, {moving.shape} != ({k},)")
    if req_slots.shape != (n,) or seq_lens.shape != (n,):
        raise ValueError(f"req_slots {req_slots.shape} and seq_lens {seq_lens.shape} != ({n},)")
    if out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"out: int32 with contiguous rows, got {out.dtype} {out.stride()}")
    if key.dtype != torch.int64 or phase.dtype != torch.int64:
        raise ValueError(f"key and phase: int64, got {key.dtype}, {phase.dtype}")


def trace_topk(
    key: torch.Tensor,
    phase: torch.Tensor,
    moving: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    epoch: int,
    flicker: float,
    alternates: int,
    per_slot: bool,
) -> None:
    """One layer's selection into `out` [n, k] (int32, rows contiguous) from its lane constants
    key, phase [k] (int64) and moving [k] (bool); one program per (request, block of lanes)."""
    _check(key, phase, moving, req_slots, seq_lens, out)
    n, k = out.shape
    if n == 0:
        return
    grid = (n, triton.cdiv(k, _BLOCK))
    _trace_kernel[grid](
        key,
        phase,
        moving.view(torch.uint8),
        req_slots.contiguous(),  # a no-op on the engine's batch slices
        seq_lens.contiguous(),
        out,
        k,
        out.stride(0),
        EPOCH=epoch,
        FLICKER=int(65536 * flicker),
        ALTERNATES=alternates,
        PER_SLOT=per_slot,
        BLOCK=_BLOCK,
    )
