"""DeepSeek-V3.2 lightning-indexer scores over the paged index-key pool of one layer.

score[b, t] = sum_h w[b, h] * relu(q[b, h] . key_t) for t < seq_len, -inf beyond. Keys are read
once, straight from the pool through the page table; the kernel is bound by those key bytes.
"""

from __future__ import annotations

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels.formats import INDEX_DIM, IndexFormat, IndexKernel
from kernels.interpreter import INTERPRETED
from kernels.select.index_query import f16_query, fp8_query
from kernels.select.topk import topk_select
from kernels.tiles import bf16_dot

# docs/ARCHITECTURE.md lists top-k selection with the indexer; it lives in kernels/select/topk.py.
__all__ = ["indexer_scores", "topk_select"]


@triton.jit
def _load_keys(
    pool_ptr,
    scale_ptr,
    page,
    in_page,
    ok,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    ALIGN: tl.constexpr,
    Q_FP8: tl.constexpr = False,
):
    """Keys [BLOCK_T, D] (bf16, or f16 for fp8 keys; Q_FP8: the e4m3 values as stored) and the
    per-token scale (1.0 for bf16)."""
    d = tl.arange(0, D)
    if FP8:
        # Page-blocked fp8 pool: a page is PAGE rows of D values, then PAGE fp32 scales. Every
        # token's values start ALIGN-aligned (16 B when PAGE % 4 == 0), so they load as 16 B
        # vectors; Triton cannot prove it through page * PAGE * 132, hence the hint.
        page_bytes = page * (PAGE * (D + 4))
        start = tl.multiple_of(page_bytes + in_page * D, ALIGN)
        keys = tl.load(pool_ptr + start[:, None] + d[None, :], mask=ok[:, None], other=0)
        keys = keys.to(tl.float8e4nv, bitcast=True)
        if not Q_FP8:
            # e4m3 -> f16 is exact and one native cvt per two values (-> bf16 costs two more).
            keys = keys.to(tl.float16)
        scale = tl.load(
            scale_ptr + page * (PAGE * (D + 4) // 4) + PAGE * (D // 4) + in_page, mask=ok, other=0.0
        )
    else:
        start = tl.multiple_of((page * PAGE + in_page) * D, D)
        keys = tl.load(pool_ptr + start[:, None] + d[None, :], mask=ok[:, None], other=0)
        scale = tl.full(page.shape, 1.0, tl.float32)
    return keys, scale


@triton.jit
def _tile_keys(
    pool_ptr,
    scale_ptr,
    pages,
    i,
    t0,
    n,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILES: tl.constexpr,
    Q_FP8: tl.constexpr = False,
):
    """Tokens, validity, keys and scales of tile i (no token is valid for i >= TILES)."""
    t = t0 + i * BLOCK_T + tl.arange(0, BLOCK_T)
    page = tl.sum(tl.where(tl.arange(0, TILES)[:, None] == i, pages, 0), axis=0)
    ok = (t < n) & (page >= 0) & (i < TILES)
    keys, scale = _load_keys(
        pool_ptr, scale_ptr, page.to(tl.int64), t % PAGE, ok, D, PAGE, FP8, ALIGN, Q_FP8
    )
    return t, ok, keys, scale


@triton.jit
def _indexer_kernel(
    q_ptr,
    w_ptr,
    pool_ptr,
    scale_ptr,
    page_table_ptr,
    req_slots_ptr,
    seq_lens_ptr,
    out_ptr,
    C,
    max_tokens,
    s_q_b,
    s_q_h,
    s_w_b,
    s_pt_r,
    s_o_b,
    N_HEADS: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILES: tl.constexpr,
    REG_PREFETCH: tl.constexpr,
    ROWS_FIRST: tl.constexpr,
    UPCAST: tl.constexpr,
    Q_FP8: tl.constexpr = False,
):
    # Which grid axis walks the batch rows changes only the launch order (see indexer_scores).
    b = tl.program_id(0) if ROWS_FIRST else tl.program_id(1)
    chunk = tl.program_id(1) if ROWS_FIRST else tl.program_id(0)
    r = tl.load(req_slots_ptr + b)
    # Tokens past the page table's reach are bad input: scored -inf, never read.
    n = tl.minimum(tl.load(seq_lens_ptr + b), max_tokens)
    n = tl.where(r < 0, 0, n)
    hd = tl.arange(0, N_HEADS)
    q = tl.load(q_ptr + b * s_q_b + hd[:, None] * s_q_h + tl.arange(0, D)[None, :])
    w = tl.load(w_ptr + b * s_w_b + hd)
    if Q_FP8:
        # e4m3 x e4m3 dot (V3.2's indexer); each head's power of two comes back through w.
        q, up = fp8_query(q, UPCAST)
        w = w * up
    elif FP8:
        # f16 x f16 dot for fp8 keys; the power of two comes back through the weights.
        q, up = f16_query(q)
        w = w * up
    # The page ids of all tiles are looked up before the tile loop: key loads whose addresses
    # come from no load inside the loop are what Triton's pipeliner keeps num_stages - 1 tiles
    # ahead (a page-table load in the loop limits it to one tile, waited for every step).
    t0 = chunk * TILES * BLOCK_T
    t_all = t0 + tl.arange(0, TILES * BLOCK_T)
    pages = tl.load(
        page_table_ptr + r.to(tl.int64) * s_pt_r + t_all // PAGE, mask=t_all < n, other=-1
    )
    pages = tl.reshape(pages, [TILES, BLOCK_T])
    if REG_PREFETCH:
        t, ok, keys, scale = _tile_keys(
            pool_ptr, scale_ptr, pages, 0, t0, n, D, PAGE, FP8, ALIGN, BLOCK_T, TILES, Q_FP8
        )
    for i in range(TILES):
        if REG_PREFETCH:
            # Register double buffer (use with num_stages=1): the pipeliner's shared-memory
            # copies of fp8 tiles are 8 B wide, plain loads of 16 B aligned rows are 16 B wide.
            t_n, ok_n, keys_n, scale_n = _tile_keys(
                pool_ptr, scale_ptr, pages, i + 1, t0, n, D, PAGE, FP8, ALIGN, BLOCK_T, TILES, Q_FP8
            )
        else:
            t, ok, keys, scale = _tile_keys(
                pool_ptr, scale_ptr, pages, i, t0, n, D, PAGE, FP8, ALIGN, BLOCK_T, TILES, Q_FP8
            )
        s = bf16_dot(keys, tl.trans(q), None, UPCAST) * scale[:, None]  # [BLOCK_T, N_HEADS]
        score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
        tl.store(out_ptr + b * s_o_b + t, tl.where(ok, score, float("-inf")), mask=t < C)
        if REG_PREFETCH:
            t, ok, keys, scale = t_n, ok_n, keys_n, scale_n


def _check_args(q, w, pool, page_table, req_slots, seq_lens, out, fmt: IndexFormat) -> None:
    """Validates shapes, dtypes and strides against the index-key format."""
    if fmt.kernel is None:
        raise ValueError(f"index format {fmt.name} has no Triton kernel: use the references")
    if pool.shape[-1] != fmt.key_bytes:
        raise ValueError(f"index keys of {pool.shape[-1]} bytes do not match {fmt.describe()}")
    bs, n_heads, dim = q.shape
    if (
        q.dtype != torch.bfloat16
        or dim != INDEX_DIM
        or q.stride(-1) != 1
        or w.shape != (bs, n_heads)
        or w.dtype != torch.float32
        or w.stride(-1) != 1
    ):
        raise ValueError(
            f"q must be [bs, H, {INDEX_DIM}] bf16 and w [bs, H] fp32, unit last stride"
        )
    if n_heads < 16 or n_heads & (n_heads - 1):
        raise ValueError(f"the head count must be a power of two >= 16, got {n_heads}")
    if pool.dtype != torch.uint8 or pool.dim() != 3 or not pool.is_contiguous():
        raise ValueError("index_pool_layer must be a contiguous [num_pages, P, I] uint8 tensor")
    for name, t, dt, nd in (
        ("page_table", page_table, torch.int32, 2),
        ("req_slots", req_slots, torch.int32, 1),
        ("seq_lens", seq_lens, torch.int32, 1),
        ("out_scores", out, torch.float32, 2),
    ):
        rows_ok = name == "page_table" or t.shape[0] == bs
        if t.dtype != dt or t.dim() != nd or t.stride(-1) != 1 or not rows_ok:
            raise ValueError(
                f"{name}: expected {nd}-d {dt} with unit last stride "
                f"(batch {bs}), got {tuple(t.shape)} {t.dtype}"
            )


def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool_layer: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    out_scores: torch.Tensor,
    *,
    index_format: IndexFormat,
    block_t: int = 128,
    tiles: int = 4,
    num_warps: int = 4,
    num_stages: int | None = None,
    reg_prefetch: bool | None = None,
    rows_first: bool = False,
    query_fp8: bool = False,
) -> None:
    """Lightning-indexer scores of every stored token of each batch row.

    q [bs, 64, 128] bf16, w [bs, 64] fp32, index_pool_layer [num_pages, P, I] uint8 contiguous
    (I = index_format.key_bytes: bf16 keys, or fp8 e4m3 keys page-blocked: each page holds its
    P x 128 values then its P fp32 scales, see kernels.reference.page_views), page_table
    [R, max_pages] int32, req_slots [bs] int32 (-1 = padding row), seq_lens [bs] int32,
    out_scores [bs, C] fp32.
    out_scores[b, t] = sum_h w[b, h] * relu(q[b, h] . key_t) for t < min(seq_len, C), else -inf;
    a padding row, a token whose page id is < 0 or past the page table's columns scores -inf and
    reads no key.
    `index_format` (kernels.formats) picks the kernel variant. Allocates nothing.
    Tunables: block_t tokens per tile, tiles per program, num_warps, num_stages (tiles in
    flight + 1, through shared memory) or reg_prefetch (the next tile in registers, with
    num_stages=1). Defaults: bf16 keys num_stages=3 (16 B async copies); fp8 keys reg_prefetch
    (Triton 3.6 stages fp8 tiles with 8 B copies; plain loads of the 16 B aligned values of a
    page-blocked pool are 16 B wide when P % 4 == 0).
    rows_first: launch the batch rows of one token chunk next to each other instead of one row's
    chunks: rows whose page tables name the same pages (a shared prefix, a request's speculative
    verify rows) then read those keys at about the same time, from L2 after the first. Every
    score keeps its bits (each program computes what it did before). Off: it gained 3.6% for
    bf16 keys and nothing for fp8 with a shared prefix (run AC; docs/DECISIONS.md).
    query_fp8 (fp8 keys only): V3.2's own indexer numerics, e4m3 x e4m3 products on the fp8
    tensor cores with q cast to e4m3 per head (a power-of-two scale per head folded into w;
    kernels.reference.ref_indexer_scores has the rule); the keys are used as stored, with no
    conversion (by default through 3-stage async copies: the register prefetch shuffles fp8 bytes,
    401 PRMT a tile in the sm_90 SASS). Off: keys are converted to f16 and q kept to f16's
    precision.
    """
    _check_args(q, w, index_pool_layer, page_table, req_slots, seq_lens, out_scores, index_format)
    bs, n_heads, dim = q.shape
    if bs == 0 or out_scores.shape[1] == 0:
        return
    fp8 = index_format.kernel is IndexKernel.FP8
    if query_fp8 and not fp8:
        raise ValueError(f"query_fp8 needs fp8 index keys, not {index_format.describe()}")
    page = index_pool_layer.shape[1]
    # fp8 keys converted in registers: prefetched there; used as stored (query_fp8): async copies.
    reg_prefetch = (fp8 and not query_fp8) if reg_prefetch is None else reg_prefetch
    num_stages = (1 if reg_prefetch else 3) if num_stages is None else num_stages
    pool = index_pool_layer if fp8 else index_pool_layer.view(torch.bfloat16)
    # bf16 keys carry no scale; the pool itself stands in for the unused pointer.
    scale = index_pool_layer.view(torch.float32) if fp8 else pool
    cols = out_scores.shape[1]
    chunks = triton.cdiv(cols, block_t * tiles)
    grid = (bs, chunks) if rows_first else (chunks, bs)
    _indexer_kernel[grid](
        q,
        w,
        pool,
        scale,
        page_table,
        req_slots,
        seq_lens,
        out_scores,
        cols,
        min(cols, page_table.shape[1] * index_pool_layer.shape[1]),
        q.stride(0),
        q.stride(1),
        w.stride(0),
        page_table.stride(0),
        out_scores.stride(0),
        N_HEADS=n_heads,
        D=dim,
        PAGE=page,
        FP8=fp8,
        # Largest power of two dividing every value offset page * P * I + t * 128 (bytes).
        ALIGN=min(128, (page * index_format.key_bytes) & -(page * index_format.key_bytes)),
        BLOCK_T=block_t,
        TILES=tiles,
        REG_PREFETCH=reg_prefetch,
        ROWS_FIRST=rows_first,
        UPCAST=INTERPRETED,
        Q_FP8=query_fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
