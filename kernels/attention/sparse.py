"""Absorbed MLA decode attention over a per-row list of KV slots (DeepSeek-V3.2 sparse attention).

One public entry, `sparse_mla_decode`; the workspace it is given picks the kernels:
- `TileWorkspace`: the two-pass decode (kernels/attention/two_pass.py), every head of a request
  on one shared K tile; its launch configuration comes from kernels/attention/configs.py, the
  table measured per (row format's kernel variant, batch), unless one is passed.
- `AttnWorkspace` with more than one split: the fused kernel with split-k and a combine.
- none: the fused kernel in a single pass (prefill chunks).
Whatever runs, the summation order depends only on the slot list and the workspace (its tile
rows or split count), never on timing or batch size: no atomics, and two KV layouts that gather
the same rows in the same order give bitwise-identical output.

Slot list: `slots[b, i] >= 0` names kv's row `row_base[b] + slots[b, i]`, -1 no row (skipped).
Given the host tier (`host`, pinned rows the GPU addresses, kernels/uva.py), `slots[b, i] <= -2`
names its row `-2 - slots[b, i]`, read in place: the bytes a copy into kv would have placed, in
the same order, so the same bits. Without it every negative entry is skipped (HOST_ROWS off)."""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton

from kernels.attention import fused as fused
from kernels.attention import split as split
from kernels.attention import two_pass as two_pass
from kernels.attention.configs import LaunchConfig, launch_config
from kernels.attention.workspace import (
    AttnWorkspace,
    TileWorkspace,
    check_split_workspace,
    decode_num_splits,
)
from kernels.formats import BF16_ROW, LATENT_DIM, ROPE_DIM, RowFormat, RowKernel
from kernels.interpreter import INTERPRETED
from kernels.tiles import bf16_dot
from kernels.uva import UVATensor

__all__ = [
    "AttnWorkspace",
    "LaunchConfig",
    "TileWorkspace",
    "bf16_dot",
    "decode_num_splits",
    "sparse_mla_decode",
]

_LOG2E = 1.4426950408889634
# Under the interpreter the cost is per program: fewest programs (bits are launch-independent).
_INTERPRETER_LAUNCH = LaunchConfig(chunk=1 << 16, mix_cols=512)


def _check_rowmajor(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim or t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected {ndim}-d {dtype} with unit last stride, "
            f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_args(q_nope, q_pe, kv, row_base, slots, out, lse, row_format: RowFormat) -> None:
    bs, n_heads, d_v = q_nope.shape
    d_pe = q_pe.shape[-1]
    _check_rowmajor("q_nope", q_nope, torch.bfloat16, 3)
    _check_rowmajor("q_pe", q_pe, torch.bfloat16, 3)
    if row_format.kernel is None:
        raise ValueError(f"row format {row_format.name} has no Triton kernel: use the references")
    if row_format.kernel is RowKernel.FP8:
        # fp8 rows: the kernel hard-codes the byte layout of a 512 + 64 row (kernels.store.fp8_row).
        width = row_format.row_bytes
        if (
            kv.dtype != torch.uint8
            or kv.dim() != 2
            or kv.shape[1] != width
            or kv.stride() != (width, 1)
            or (d_v, d_pe) != (LATENT_DIM, ROPE_DIM)
        ):
            raise ValueError(
                f"kv: fp8 rows must be contiguous [n, {width}] uint8 with "
                f"{LATENT_DIM} + {ROPE_DIM} values, got {tuple(kv.shape)} strides {kv.stride()}"
            )
    else:
        _check_rowmajor("kv", kv, torch.bfloat16, 2)
    _check_rowmajor("slots", slots, torch.int32, 2)
    _check_rowmajor("out", out, torch.bfloat16, 3)
    _check_rowmajor("lse", lse, torch.float32, 2)
    if (
        tuple(q_pe.shape[:2]) != (bs, n_heads)
        or (row_format.kernel is RowKernel.BF16 and kv.shape[1] != d_v + d_pe)
        or slots.shape[0] != bs
        or tuple(out.shape) != (bs, n_heads, d_v)
        or tuple(lse.shape) != (bs, n_heads)
    ):
        raise ValueError("shape mismatch between q_nope, q_pe, kv, slots, out and lse")
    if d_v & (d_v - 1) or d_pe & (d_pe - 1):
        raise ValueError(f"latent and rope widths must be powers of two, got {d_v} and {d_pe}")
    if row_base.shape != (bs,) or row_base.dtype != torch.int64:
        raise ValueError(
            f"row_base: expected [{bs}] int64, got {tuple(row_base.shape)} {row_base.dtype}"
        )


def _host_offset(kv: torch.Tensor, host: torch.Tensor | UVATensor | None) -> int | None:
    """The kernels' host_off: host's first element in kv elements from kv's (either sign), None
    without a host tier. The kernels address host rows as kv's: same dtype, width and strides,
    16-byte aligned relative to kv (the gathers load 16-byte vectors)."""
    if host is None:
        return None
    if (
        host.dtype != kv.dtype
        or len(host.shape) != 2
        or host.shape[1] != kv.shape[1]
        or tuple(host.stride()) != tuple(kv.stride())
    ):
        raise ValueError(
            f"host: expected [n, {kv.shape[1]}] {kv.dtype} rows with kv's strides {kv.stride()}, "
            f"got {tuple(host.shape)} {host.dtype} strides {tuple(host.stride())}"
        )
    if isinstance(host, torch.Tensor) and host.device != kv.device and not host.is_pinned():
        # A GPU reads host memory in place only where it is pinned (mapped for UVA).
        raise ValueError(f"host: on {host.device} beside kv on {kv.device}, and not pinned")
    size = kv.element_size()
    delta = host.data_ptr() - kv.data_ptr()
    if delta % 16 or (kv.stride(0) * size) % 16:
        raise ValueError(
            f"host: rows must start 16-byte aligned relative to kv's "
            f"(distance {delta} B, row stride {kv.stride(0) * size} B)"
        )
    return delta // size


def score_pass(
    q_nope, q_pe, kv, row_base, slots, qk_scale, ws, cfg, row_format, host_off=None
) -> None:
    """The two-pass decode's first kernel (checked arguments): tile probabilities into ws."""
    bs, n_heads, d_v = q_nope.shape
    k, bt = slots.shape[1], ws.block_t
    chunk = max(cfg.chunk, bt)
    heads = max(16, min(cfg.score_heads, triton.next_power_of_2(n_heads)))
    p, pm, ps = ws.probs, ws.tile_max, ws.tile_sum
    two_pass._score_kernel[(triton.cdiv(k, chunk), bs, triton.cdiv(n_heads, heads))](
        q_nope,
        q_pe,
        kv,
        host_off,
        row_base,
        slots,
        p,
        pm,
        ps,
        qk_scale,
        n_heads,
        k,
        chunk,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv.stride(0),
        slots.stride(0),
        *_tile_strides(ws),
        D_V=d_v,
        D_PE=q_pe.shape[-1],
        BLOCK_H=heads,
        BLOCK_T=bt,
        STAGE=max(bt, min(512, triton.next_power_of_2(chunk))),
        PREFETCH=cfg.score_prefetch,
        **_variant(row_format, host_off),
        num_warps=cfg.score_warps,
        num_stages=cfg.score_stages,
    )


def mix_pass(kv, row_base, slots, out, lse, ws, cfg, row_format, host_off=None) -> None:
    """The two-pass decode's second kernel (checked arguments): out and lse from ws's tiles."""
    bs, n_heads, d_v = out.shape
    k, bt = slots.shape[1], ws.block_t
    heads = max(16, min(cfg.mix_heads, triton.next_power_of_2(n_heads)))
    cols = min(cfg.mix_cols, d_v)
    two_pass._mix_kernel[(triton.cdiv(d_v, cols), bs, triton.cdiv(n_heads, heads))](
        ws.probs,
        ws.tile_max,
        ws.tile_sum,
        kv,
        host_off,
        row_base,
        slots,
        out,
        lse,
        n_heads,
        k,
        kv.stride(0),
        slots.stride(0),
        *_tile_strides(ws),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        BLOCK_H=heads,
        BLOCK_T=bt,
        BLOCK_D=cols,
        NT_POW2=triton.next_power_of_2(triton.cdiv(k, bt)),
        STAGE=max(bt, min(512, triton.next_power_of_2(k))),
        FLAT=cfg.mix_flat,
        **_variant(row_format, host_off),
        num_warps=cfg.mix_warps,
        num_stages=cfg.mix_stages,
        **({} if cfg.mix_maxnreg is None else {"maxnreg": cfg.mix_maxnreg}),
    )


def _variant(row_format: RowFormat, host_off: int | None) -> dict[str, bool]:
    """The two-pass kernels' compile-time variant: interpreter, row format, host tier."""
    fp8 = row_format.kernel is RowKernel.FP8
    return dict(UPCAST=INTERPRETED, ROW_FP8=fp8, HOST_ROWS=host_off is not None)


def _tile_strides(ws: TileWorkspace) -> tuple[int, ...]:
    p, pm = ws.probs, ws.tile_max
    return (p.stride(0), p.stride(1), p.stride(2), pm.stride(0), pm.stride(1))


def sparse_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_base: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    row_format: RowFormat = BF16_ROW,
    workspace: AttnWorkspace | TileWorkspace | None = None,
    launch: LaunchConfig | None = None,
    host: torch.Tensor | UVATensor | None = None,
    **fused_knobs: int,
) -> None:
    """Absorbed MLA decode over the KV rows `row_base[b] + slots[b, i]`; slots < 0 are skipped,
    unless `host` is given: then slot -1 is skipped and slot <= -2 reads `host[-2 - slot]`.

    q_nope [bs, H, 512] bf16, q_pe [bs, H, 64] bf16, kv the rows as `row_format` has attention
    read them: bf16 [n_rows, 576] (latent then rope key), or DeepSeek-V3.2 fp8 rows uint8
    (kernels.store.fp8_row, dequantized in kernels.attention.kv_tiles), row_base [bs] int64,
    slots [bs, k] int32, out [bs, H, 512] bf16, lse [bs, H] fp32.
    score_i = scale * (q_nope . kv[row, :512] + q_pe . kv[row, 512:]);
    out = softmax . kv[row, :512];
    lse = natural-log log-sum-exp of the scores. A row with no valid slot gets out = 0, lse = -inf.
    workspace: see the module doc. launch: the two-pass configuration (default: the measured
    table); fused_knobs: the fused kernel's tunables (kernels.attention.fused.fused_setup;
    with split-k also combine_heads, combine_warps).
    host: the host tier's rows laid out as kv's (a UVATensor or pinned tensor beside a GPU kv).
    A host row past its end is the caller's contract violation, unchecked (the plan emits none).
    Allocates nothing and never synchronizes.
    """
    _check_args(q_nope, q_pe, kv, row_base, slots, out, lse, row_format)
    host_off = _host_offset(kv, host)
    if q_nope.shape[0] == 0:
        return
    qk_scale = scale * _LOG2E
    if isinstance(workspace, TileWorkspace):
        cfg = launch or (
            _INTERPRETER_LAUNCH if INTERPRETED else launch_config(row_format, q_nope.shape[0])
        )
        workspace.check(q_nope.shape[0], q_nope.shape[1], slots.shape[1])
        score_pass(
            q_nope, q_pe, kv, row_base, slots, qk_scale, workspace, cfg, row_format, host_off
        )
        mix_pass(kv, row_base, slots, out, lse, workspace, cfg, row_format, host_off)
        return
    if workspace is not None and workspace.num_splits > 1:
        check_split_workspace(workspace, *q_nope.shape)
        split.launch_split(
            q_nope, q_pe, kv, row_base, slots, qk_scale, out, lse, row_format, workspace,
            host_off=host_off, **fused_knobs,
        )  # fmt: skip
    else:
        fused.launch_fused(
            q_nope, q_pe, kv, row_base, slots, qk_scale, out, lse, row_format,
            host_off=host_off, **fused_knobs,
        )  # fmt: skip
