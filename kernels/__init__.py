"""Triton kernels of the HiSparse data path, each with a PyTorch reference in `kernels.reference`.

Without CUDA the kernels run under Triton's interpreter. The switch must be set before any
`@triton.jit` function is defined, so it lives here, at package import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
