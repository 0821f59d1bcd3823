"""The kernel implementations a process launches, chosen once and passed down explicitly.

`KernelSet.triton()` is the real data path (Triton on GPU, Triton's interpreter on CPU);
`KernelSet.reference()` swaps in the plain-PyTorch references of `kernels.reference`, which
share the wrappers' signatures (useful to bisect a mismatch; not graph capturable).
`KernelSet.choose` owns the rule for `auto` that the engine's --kernels and the service's
remote swap both follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# The names `KernelSet.choose` takes (the engine's --kernels).
CHOICES = ("auto", "triton", "reference")


@dataclass(frozen=True)
class KernelSet:
    kv_append: Callable[..., None]
    swap_plan: Callable[..., None]
    miss_copy: Callable[..., None]
    sparse_mla_decode: Callable[..., None]
    indexer_scores: Callable[..., None]
    topk_select: Callable[..., None]
    # The all-on-GPU baseline's pool rows of a selection through its page table (and the
    # selected counters): page_rows(topk, req_slots, page_table, page_size, out, counts=None).
    page_rows: Callable[..., None]
    # rows [n, 576] bf16 -> stored rows [n, row_bytes] uint8 of a format with a quantize function
    # (the bytes kv_append writes for it): kv_quantize(rows, out, row_format=...).
    kv_quantize: Callable[..., None]
    # Batch-invariant dense math (kernels.dense; the model's --batch-invariant mode): linear(x,
    # w), bmm(a, b), rms_norm(x, w, eps), layer_norm(x, w, b, eps), each returning a new tensor.
    linear: Callable[..., Any]
    bmm: Callable[..., Any]
    rms_norm: Callable[..., Any]
    layer_norm: Callable[..., Any]
    # The model's default math, PyTorch's bits in fewer launches (kernels.dense.rms_norm, .rope):
    # norm(x, w, eps) RMSNorm -> new tensor; rotate(x, cos, sin, interleaved, out=None) RoPE of
    # x [n, (H,) r] into out (new if None, x itself in place).
    norm: Callable[..., Any]
    rotate: Callable[..., Any]
    capturable: bool = True

    @classmethod
    def choose(cls, name: str, device_type: str) -> "KernelSet":
        """name one of CHOICES. 'auto': Triton on CUDA; on CPU the torch references, because
        Triton's interpreter runs the engine ~30x slower and made a CPU remote-swap step 0.34 s
        against 0.02 s (both compute the same function, checked by the kernel tests)."""
        if name not in CHOICES:
            raise ValueError(f"kernels must be one of {CHOICES}, got {name!r}")
        if name == "triton" or (name == "auto" and device_type == "cuda"):
            return cls.triton()
        return cls.reference()

    @classmethod
    def triton(cls) -> "KernelSet":
        from kernels.attention.sparse import sparse_mla_decode
        from kernels.dense.matmul import invariant_bmm, invariant_linear
        from kernels.dense.rms_norm import rms_norm
        from kernels.dense.rope import rotate
        from kernels.dense.row_norm import invariant_layer_norm, invariant_rms_norm
        from kernels.select.indexer import indexer_scores
        from kernels.select.page_rows import page_rows
        from kernels.select.topk import topk_select
        from kernels.store.append import kv_append
        from kernels.store.fp8_row import kv_quantize
        from kernels.swap.miss_copy import miss_copy
        from kernels.swap.plan import swap_plan

        return cls(
            kv_append=kv_append,
            swap_plan=swap_plan,
            miss_copy=miss_copy,
            sparse_mla_decode=sparse_mla_decode,
            indexer_scores=indexer_scores,
            topk_select=topk_select,
            page_rows=page_rows,
            kv_quantize=kv_quantize,
            linear=invariant_linear,
            bmm=invariant_bmm,
            rms_norm=invariant_rms_norm,
            layer_norm=invariant_layer_norm,
            norm=rms_norm,
            rotate=rotate,
        )

    @classmethod
    def reference(cls) -> "KernelSet":
        from kernels import reference as ref

        return cls(
            kv_append=ref.ref_kv_append,
            swap_plan=ref.ref_swap_plan,
            miss_copy=ref.ref_miss_copy,
            sparse_mla_decode=ref.ref_sparse_mla_decode,
            indexer_scores=ref.ref_indexer_scores,
            topk_select=ref.ref_topk_select,
            page_rows=ref.ref_page_rows,
            kv_quantize=ref.ref_kv_quantize,
            linear=ref.ref_invariant_linear,
            bmm=ref.ref_invariant_bmm,
            rms_norm=ref.ref_invariant_rms_norm,
            layer_norm=ref.ref_invariant_layer_norm,
            norm=ref.ref_rms_norm,
            rotate=ref.ref_rotate,
            capturable=False,
        )
