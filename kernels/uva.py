"""Pinned host memory presented to Triton as a device pointer.

With unified virtual addressing the device address of pinned (or cudaHostRegister-ed) host memory
equals its host address, so a kernel can load host rows directly over PCIe ("zero-copy").
Triton only needs `data_ptr()` and `dtype` from a pointer argument.
"""

from __future__ import annotations

import torch


class UVATensor:
    """A pinned CPU tensor that Triton kernels on the GPU read and write in place."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError("UVATensor wraps host memory")
        if not tensor.is_pinned():
            raise ValueError("host memory must be pinned or registered for the GPU to address it")
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.shape = tensor.shape

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def stride(self, dim: int | None = None):
        return self.tensor.stride() if dim is None else self.tensor.stride(dim)

    def view(self, dtype: torch.dtype) -> "UVATensor":
        return UVATensor(self.tensor.view(dtype))

    def map(self, fn) -> "UVATensor":
        """fn's view of the pinned tensor (a reshape or dtype view), still device-addressable."""
        return UVATensor(fn(self.tensor))

    def is_contiguous(self) -> bool:
        return self.tensor.is_contiguous()
