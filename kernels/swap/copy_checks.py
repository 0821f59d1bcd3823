"""The miss copy wrapper's argument checks (kernels/swap/miss_copy.py): row widths, dtypes,
shapes and where each tier lives, before anything is launched."""

from __future__ import annotations

import torch


def check_copy(host_rows, hot_rows, miss_src, miss_dst, miss_count) -> None:
    D = host_rows.shape[-1]
    if hot_rows.shape[-1] != D or D % 4 != 0:
        raise ValueError(f"row bytes must match and be a multiple of 4: {D}, {hot_rows.shape[-1]}")
    if host_rows.dtype != torch.uint8 or hot_rows.dtype != torch.uint8:
        raise ValueError("host_rows and hot_rows must be uint8")
    if not (host_rows.is_contiguous() and hot_rows.is_contiguous()):
        raise ValueError("host_rows and hot_rows must be contiguous")
    if hot_rows.is_cuda and isinstance(host_rows, torch.Tensor) and not host_rows.is_cuda:
        raise TypeError("on GPU pass the host tier as a kernels.uva.UVATensor")
    if miss_src.dim() != 2:
        raise ValueError(f"miss_src: expected [bs, k], got {tuple(miss_src.shape)}")
    bs, k = miss_src.shape
    for name, x, dtype, shape in (
        ("miss_src", miss_src, torch.int64, (bs, k)),
        ("miss_dst", miss_dst, torch.int64, (bs, k)),
        ("miss_count", miss_count, torch.int32, (bs,)),
    ):
        if x.dtype != dtype or tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(
                f"{name}: expected contiguous {shape} {dtype}, got {tuple(x.shape)} {x.dtype}"
            )


def check_landing(landing: torch.Tensor | None, hot_rows: torch.Tensor) -> None:
    if landing is None:
        return
    D = hot_rows.shape[-1]
    if landing.dtype != torch.uint8 or landing.dim() != 2 or landing.shape[1] != D:
        raise ValueError(f"landing: expected [rows, {D}] uint8, got {tuple(landing.shape)}")
    if landing.device != hot_rows.device or not landing.is_contiguous():
        raise ValueError(f"landing must be contiguous on {hot_rows.device}, got {landing.device}")
