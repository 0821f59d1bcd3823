"""What a kernel's name says: one classifier (`classify`, first matching pattern wins) and its
two tables. CATEGORIES names the kernels of ours (Triton kernels, and on CPU the
"kernel::<KernelSet field>" ranges) and the GEMMs; KINDS splits PyTorch's own kernels
(elementwise, reduce, cat, copy, ...) where no model part is known (bench.profile.parts)."""

from __future__ import annotations

import re

GEMM = r"gemm|xmma|cutlass|nvjet|cublas|splitK|aten::(mm|addmm|bmm|matmul|linear)$"

# GPU kernel names (Triton kernels, cuBLAS/CUTLASS GEMMs) and, on CPU, the
# "kernel::<KernelSet field>" ranges and aten GEMM ops.
CATEGORIES = (
    ("miss copy", r"miss_copy"),
    # The shared hot region's launches around the plan (kernels/swap/shared_phase.py): run Z's
    # N 548 profile charged their 1.2 ms a step to "plan glue" / "unnamed".
    ("plan: shared phase", r"shared_(lookup|count|victims|finish)"),
    ("plan", r"swap_plan"),
    ("append", r"kv_append|index_copy|index_put|indexFunc"),
    ("indexer", r"indexer"),
    ("top-k", r"topk|_pass_kernel|_compact_kernel|radix"),
    (
        "attention",
        r"sparse_mla|_score_kernel|_mix_kernel|_fused_kernel|_split_kernel|_combine_kernel|attention",
    ),
    ("rope", r"_rope_kernel|::rotate$"),
    ("norms", r"_rms_(square|scale)_kernel|::norm$"),
    ("MLP/GEMM", GEMM),
)
OTHER = "other"  # a name no category matches

# PyTorch kernel names -> kind; for kernels no part or category names.
KINDS = (
    ("GEMM", GEMM),
    ("cat", r"CatArray|aten::cat$"),
    ("reduce", r"reduce_kernel|aten::(mean|sum|amax|max)$"),
    ("layer norm", r"layer_norm|LayerNorm"),
    ("index/gather", r"index|gather|scatter|embedding|aten::where$"),
    ("copy/cast", r"copy|Memcpy|aten::(to|_to_copy|contiguous|clone)$"),
    ("memset/fill", r"Memset|fill|aten::(zero_|fill_)$"),
    ("elementwise", r"elementwise|aten::(mul|add|sub|div|rsqrt|pow|silu|neg|clamp)"),
)
UNNAMED = "unnamed"  # a name no kind matches


def classify(name: str, table: tuple[tuple[str, str], ...], default: str) -> str:
    """The label of the first pattern of `table` found in `name` (case-insensitive)."""
    for label, pattern in table:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return default


def category(name: str) -> str:
    """A kernel of ours, or a GEMM, by its name; OTHER for the rest."""
    return classify(name, CATEGORIES, OTHER)


def kernel_kind(name: str) -> str:
    """What a PyTorch kernel does, by its name; UNNAMED when no kind matches."""
    return classify(name, KINDS, UNNAMED)


def is_gemm(name: str) -> bool:
    return re.search(GEMM, name, re.IGNORECASE) is not None
