"""Triton kernels of the HiSparse data path, each with a PyTorch reference in `kernels.reference`.

Importing the package imports nothing heavy: `kernels.formats` (the KV row and index-key formats)
is read by the command line before torch is needed. Without CUDA the kernels run under Triton's
interpreter; `kernels.interpreter` sets that switch, and every module with a `@triton.jit`
function imports it first.
"""
