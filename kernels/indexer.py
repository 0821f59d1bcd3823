"""DeepSeek-V3.2 lightning-indexer scores over the paged index-key pool of one layer.

score[b, t] = sum_h w[b, h] * relu(q[b, h] . key_t) for t < seq_len, -inf beyond. Keys are read
once, straight from the pool through the page table; the kernel is bound by those key bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sparse_attention import INTERPRETED, bf16_dot
from kernels.topk import topk_select

# docs/ARCHITECTURE.md lists top-k selection with the indexer; it lives in kernels/topk.py.
__all__ = ["indexer_scores", "topk_select"]

INDEX_DIM = 128
_KEY_BYTES = {"bf16": 2 * INDEX_DIM, "fp8": INDEX_DIM + 4}


@triton.jit
def _load_keys(pool_ptr, scale_ptr, row, ok, D: tl.constexpr, ROW_ELEMS: tl.constexpr,
               FP8: tl.constexpr):
    """Keys [BLOCK_T, D] as bf16 and the per-token scale (1.0 for bf16 keys)."""
    d = tl.arange(0, D)
    # Constexpr row sizes give 16 B vectors for bf16 keys. Triton 3.6 over-estimates the alignment of row * 132 (it emits 8 B copies on 4 B aligned
    # fp8 rows); pin it to the largest power of two dividing the row size.
    start = tl.multiple_of(row * ROW_ELEMS, ROW_ELEMS & -ROW_ELEMS)
    keys = tl.load(pool_ptr + start[:, None] + d[None, :], mask=ok[:, None], other=0)
    if FP8:
        keys = keys.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        scale = tl.load(scale_ptr + row * (ROW_ELEMS // 4) + D // 4, mask=ok, other=0.0)
    else:
        scale = tl.full(row.shape, 1.0, tl.float32)
    return keys, scale


@triton.jit
def _indexer_kernel(q_ptr, w_ptr, pool_ptr, scale_ptr, page_table_ptr, req_slots_ptr, seq_lens_ptr,
                    out_ptr, C, max_tokens, s_q_b, s_q_h, s_w_b, s_pt_r, s_o_b,
                    N_HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    ROW_ELEMS: tl.constexpr, FP8: tl.constexpr, BLOCK_T: tl.constexpr,
                    TILES: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(1)
    r = tl.load(req_slots_ptr + b)
    # Tokens past the page table's reach are bad input: scored -inf, never read.
    n = tl.minimum(tl.load(seq_lens_ptr + b), max_tokens)
    n = tl.where(r < 0, 0, n)
    hd = tl.arange(0, N_HEADS)
    q = tl.load(q_ptr + b * s_q_b + hd[:, None] * s_q_h + tl.arange(0, D)[None, :])
    w = tl.load(w_ptr + b * s_w_b + hd)
    for i in range(TILES):
        t = (tl.program_id(0) * TILES + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_seq = t < n
        page = tl.load(page_table_ptr + r.to(tl.int64) * s_pt_r + t // PAGE, mask=in_seq, other=-1)
        ok = in_seq & (page >= 0)
        row = page.to(tl.int64) * PAGE + t % PAGE
        keys, scale = _load_keys(pool_ptr, scale_ptr, row, ok, D, ROW_ELEMS, FP8)
        s = bf16_dot(keys, tl.trans(q), None, UPCAST) * scale[:, None]     # [BLOCK_T, N_HEADS]
        score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
        tl.store(out_ptr + b * s_o_b + t, tl.where(ok, score, float("-inf")), mask=t < C)


def _check_args(q, w, pool, page_table, req_slots, seq_lens, out, index_format) -> str:
    """Validates shapes, dtypes and strides; returns the index-key format."""
    fmt = index_format or {v: k for k, v in _KEY_BYTES.items()}.get(pool.shape[-1])
    if fmt not in _KEY_BYTES or pool.shape[-1] != _KEY_BYTES[fmt]:
        raise ValueError(f"index keys of {pool.shape[-1]} bytes do not match format {fmt!r}")
    bs, n_heads, dim = q.shape
    if (q.dtype != torch.bfloat16 or dim != INDEX_DIM or q.stride(-1) != 1
            or w.shape != (bs, n_heads) or w.dtype != torch.float32 or w.stride(-1) != 1):
        raise ValueError(f"q must be [bs, H, {INDEX_DIM}] bf16 and w [bs, H] fp32, unit last stride")
    if n_heads < 16 or n_heads & (n_heads - 1):
        raise ValueError(f"the head count must be a power of two >= 16, got {n_heads}")
    if pool.dtype != torch.uint8 or pool.dim() != 3 or not pool.is_contiguous():
        raise ValueError("index_pool_layer must be a contiguous [num_pages, P, I] uint8 tensor")
    for name, t, dt, nd in (("page_table", page_table, torch.int32, 2),
                            ("req_slots", req_slots, torch.int32, 1),
                            ("seq_lens", seq_lens, torch.int32, 1),
                            ("out_scores", out, torch.float32, 2)):
        rows_ok = name == "page_table" or t.shape[0] == bs
        if t.dtype != dt or t.dim() != nd or t.stride(-1) != 1 or not rows_ok:
            raise ValueError(f"{name}: expected {nd}-d {dt} with unit last stride "
                             f"(batch {bs}), got {tuple(t.shape)} {t.dtype}")
    return fmt


def indexer_scores(q: torch.Tensor, w: torch.Tensor, index_pool_layer: torch.Tensor,
                   page_table: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                   out_scores: torch.Tensor, *, index_format: str | None = None,
                   block_t: int = 128, tiles: int = 4, num_warps: int = 4,
                   num_stages: int | None = None) -> None:
    """Lightning-indexer scores of every stored token of each batch row.

    q [bs, 64, 128] bf16, w [bs, 64] fp32, index_pool_layer [num_pages, P, I] uint8 contiguous
    (I = 256: bf16 keys; I = 132: fp8 e4m3 keys then one fp32 scale), page_table [R, max_pages]
    int32, req_slots [bs] int32 (-1 = padding row), seq_lens [bs] int32, out_scores [bs, C] fp32.
    out_scores[b, t] = sum_h w[b, h] * relu(q[b, h] . key_t) for t < min(seq_len, C), else -inf;
    a padding row, a token whose page id is < 0 or past the page table's columns scores -inf and
    reads no key.
    `index_format` ("bf16" / "fp8") defaults to the one implied by I. Allocates nothing.
    num_stages defaults to 3 for bf16 keys (16 B async copies) and 1 for fp8 keys, whose 132 B
    rows only allow 4 B copies: there, async copies cost more instructions than they hide.
    """
    fmt = _check_args(q, w, index_pool_layer, page_table, req_slots, seq_lens, out_scores,
                      index_format)
    bs, n_heads, dim = q.shape
    if bs == 0 or out_scores.shape[1] == 0:
        return
    fp8 = fmt == "fp8"
    if num_stages is None:
        num_stages = 1 if fp8 else 3
    pool = index_pool_layer if fp8 else index_pool_layer.view(torch.bfloat16)
    # bf16 keys carry no scale; the pool itself stands in for the unused pointer.
    scale = index_pool_layer.view(torch.float32) if fp8 else pool
    cols = out_scores.shape[1]
    grid = (triton.cdiv(cols, block_t * tiles), bs)
    _indexer_kernel[grid](
        q, w, pool, scale, page_table, req_slots, seq_lens, out_scores, cols,
        min(cols, page_table.shape[1] * index_pool_layer.shape[1]),
        q.stride(0), q.stride(1), w.stride(0), page_table.stride(0), out_scores.stride(0),
        N_HEADS=n_heads, D=dim, PAGE=index_pool_layer.shape[1],
        ROW_ELEMS=index_pool_layer.shape[-1] if fp8 else dim, FP8=fp8, BLOCK_T=block_t,
        TILES=tiles, UPCAST=INTERPRETED, num_warps=num_warps, num_stages=num_stages)
