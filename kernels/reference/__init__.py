"""Plain-PyTorch references for every kernel in this package, one module per wing of kernels:

- `swap`: the swap-in plan and the miss copy (`ref_swap_plan`, `ref_miss_copy`)
- `store`: the KV append and the stored row encoding (`ref_kv_append`, `ref_kv_quantize`)
- `index_pool`: the index-key pool's page layout (`page_views`, `read_index_rows`, ...)
- `attention`: sparse MLA decode (`ref_sparse_mla_decode`)
- `select`: indexer scores and top-k (`ref_indexer_scores`, `ref_topk_select`), and the baseline's
  pool rows of a selection (`ref_page_rows`)
- `dense`: batch-invariant matmul and norms (`ref_invariant_linear`, `ref_invariant_rms_norm`, ...),
  the model's default RMSNorm (`ref_rms_norm`) and the rotary embedding (`ref_rotate`)

Each `ref_*` computes the same function as its kernel, written for clarity rather than speed,
with the kernel wrapper's signature (kernels.kit.kernel_set swaps them in). Tests compare
kernels against these on random inputs of irregular sizes. Everything is importable from here.
"""

from kernels.reference.attention import ref_sparse_mla_decode
from kernels.reference.dense import (
    ref_invariant_bmm,
    ref_invariant_layer_norm,
    ref_invariant_linear,
    ref_invariant_rms_norm,
    ref_rms_norm,
    ref_rotate,
)
from kernels.reference.index_pool import page_views, read_index_rows, write_index_rows
from kernels.reference.select import order_key, ref_indexer_scores, ref_page_rows, ref_topk_select
from kernels.reference.store import kv_rows_for_store, ref_kv_append, ref_kv_quantize
from kernels.reference.swap import ref_miss_copy, ref_swap_plan

__all__ = [
    "kv_rows_for_store",
    "order_key",
    "page_views",
    "read_index_rows",
    "ref_indexer_scores",
    "ref_invariant_bmm",
    "ref_invariant_layer_norm",
    "ref_invariant_linear",
    "ref_invariant_rms_norm",
    "ref_rms_norm",
    "ref_rotate",
    "ref_kv_append",
    "ref_kv_quantize",
    "ref_page_rows",
    "ref_miss_copy",
    "ref_sparse_mla_decode",
    "ref_swap_plan",
    "ref_topk_select",
    "write_index_rows",
]
