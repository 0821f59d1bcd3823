"""The argument check every kernel wrapper runs before a launch: each tensor's dtype, shape and
contiguity, since the kernels compute flat addresses from the shapes and a mix-up would read or
write out of bounds instead of failing."""

from __future__ import annotations

from typing import Any

import torch

# name -> (tensor, or a view with dtype, shape and is_contiguous such as a UVATensor; dtype; shape)
Specs = dict[str, tuple[Any, torch.dtype, tuple[int, ...]]]


def check_specs(specs: Specs) -> None:
    for name, (x, dtype, shape) in specs.items():
        if x.dtype is not dtype or tuple(x.shape) != tuple(shape) or not x.is_contiguous():
            raise ValueError(
                f"{name}: expected contiguous {tuple(shape)} {dtype}, "
                f"got {tuple(x.shape)} {x.dtype}"
            )
