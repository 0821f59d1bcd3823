"""Plain-PyTorch references for every kernel in this package.

Each `ref_*` computes the same function as its kernel, written for clarity rather than speed.
Tests compare kernels against these on random inputs of irregular sizes.
"""

from __future__ import annotations

import torch

# --- swap-in: plan, miss copy, append (owned by kernels/swap_plan.py, miss_copy.py, kv_append.py) ---

# --- end swap-in ---

# --- attention and indexer (owned by kernels/sparse_attention.py, indexer.py) ---

# --- end attention and indexer ---
