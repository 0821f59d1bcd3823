"""Triton's interpreter on machines without CUDA.

Every module that defines a `@triton.jit` function imports this one (tests/test_imports.py checks
it): the switch must be set before the first decoration, and Triton reads it at decoration time,
not at `import triton`. It lives here rather than in `kernels/__init__.py` so that importing the
package (for `kernels.formats`, which `contract.layout` and the command line read) does not import
torch, which takes seconds.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Read once, after the switch: the kernels upcast bf16 operands under the interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
