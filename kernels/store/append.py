"""KV append: store the KV row and indexer key of new tokens of one layer.

Resident requests keep token t at hot slot t. Offloaded requests write every token to the host
tier (so a later miss on it reads the right bytes) and only the newest W tokens to the window ring:
within a prefill chunk at most one token maps to each ring slot, so no two programs race on one.
Row addresses: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import Union

import torch

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl

from kernels import formats
from kernels.arg_specs import check_specs
from kernels.formats import ROW_VALUES, IndexFormat, RowFormat, RowKernel
from kernels.store.fp8_row import quantize_rows, store_fp8_rows
from kernels.uva import UVATensor

ROWS_PER_PROGRAM = 4
_RESIDENT = tl.constexpr(formats.MODE_RESIDENT)
_OFFLOADED = tl.constexpr(formats.MODE_OFFLOADED)


@triton.jit
def _load_rows(ptr, rows, mask, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.arange(0, BLOCK)
    return tl.load(
        ptr + rows[:, None] * WORDS + w[None, :], mask=mask[:, None] & (w < WORDS)[None, :]
    )


@triton.jit
def _store_rows(ptr, rows, mask, words, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.arange(0, BLOCK)
    tl.store(
        ptr + rows[:, None] * WORDS + w[None, :], words, mask=mask[:, None] & (w < WORDS)[None, :]
    )


@triton.jit
def _store_cols(ptr, starts, mask, words, LO: tl.constexpr, HI: tl.constexpr, BLOCK: tl.constexpr):
    """Words [LO, HI) of each row to ptr + starts[row] + (word - LO)."""
    w = tl.arange(0, BLOCK)
    tl.store(
        ptr + starts[:, None] + (w - LO)[None, :],
        words,
        mask=mask[:, None] & ((w >= LO) & (w < HI))[None, :],
    )


@triton.jit
def _store_index_rows(
    pool_ptr,
    page_row,
    t_in_page,
    ok,
    index,
    P: tl.constexpr,
    INDEX_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Index rows into their pool pages (page_row = layer * num_pages + page). With SCALE_WORDS
    (fp8 keys) a page is page-blocked: P rows of values, then the P scales."""
    VALUE_WORDS: tl.constexpr = INDEX_WORDS - SCALE_WORDS
    page_start = page_row * (P * INDEX_WORDS)
    _store_cols(pool_ptr, page_start + t_in_page * VALUE_WORDS, ok, index, 0, VALUE_WORDS, BLOCK)
    if SCALE_WORDS > 0:
        _store_cols(
            pool_ptr,
            page_start + P * VALUE_WORDS + t_in_page * SCALE_WORDS,
            ok,
            index,
            VALUE_WORDS,
            INDEX_WORDS,
            BLOCK,
        )


@triton.jit(do_not_specialize=["layer"])
def _kv_append_kernel(
    kv_ptr,
    index_ptr,
    req_slots_ptr,
    positions_ptr,
    seq_lens_ptr,
    req_mode_ptr,
    page_table_ptr,
    host_ptr,
    hot_ptr,
    pool_ptr,
    layer,
    n,
    R,
    B,
    max_pages,
    num_pages,
    L: tl.constexpr,
    P: tl.constexpr,
    W: tl.constexpr,
    KV_WORDS: tl.constexpr,
    INDEX_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_INDEX: tl.constexpr,
    ROWS: tl.constexpr,
    QUANT: tl.constexpr,
):
    # Rows move as int32 words (D and I are multiples of 4) so the copies vectorize. QUANT:
    # kv_ptr holds bf16 [n, 576] rows, quantized here into fp8 rows (kernels.store.fp8_row).
    index_ptr = index_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pool_ptr = pool_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = i < n
    r = tl.load(req_slots_ptr + i, mask=live, other=-1)
    t = tl.load(positions_ptr + i, mask=live, other=-1)
    seq_len = tl.load(seq_lens_ptr + i, mask=live, other=0)
    r_ok = live & (r >= 0) & (r < R)
    mode = tl.load(req_mode_ptr + r, mask=r_ok, other=0)
    ok = (
        r_ok
        & ((mode == _RESIDENT) | (mode == _OFFLOADED))
        & (t >= 0)
        & (t < seq_len)
        & (t < max_pages * P)
    )
    page = tl.load(page_table_ptr + r.to(tl.int64) * max_pages + t // P, mask=ok, other=-1)
    ok = ok & (page >= 0) & (page < num_pages)
    page = page.to(tl.int64)
    to_host = ok & (mode == _OFFLOADED)
    # Resident: slot t. Offloaded: ring slot t % W, written only for the newest W tokens.
    to_hot = (ok & (mode == _RESIDENT) & (t < B)) | (to_host & (t >= seq_len - W))
    slot = tl.where(mode == _RESIDENT, t, t % W)
    src = i.to(tl.int64)
    hot_row = (layer * R + r).to(tl.int64) * B + slot
    host_row = (page * L + layer) * P + t % P
    if QUANT:
        codes, scale, rope = quantize_rows(kv_ptr, src, ok)
        hot_ptr = hot_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        host_ptr = host_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        store_fp8_rows(hot_ptr, hot_row, to_hot, codes, scale, rope)
        store_fp8_rows(host_ptr, host_row, to_host, codes, scale, rope)
    else:
        kv_ptr = kv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        hot_ptr = hot_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        host_ptr = host_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        kv = _load_rows(kv_ptr, src, ok, KV_WORDS, BLOCK_KV)
        _store_rows(hot_ptr, hot_row, to_hot, kv, KV_WORDS, BLOCK_KV)
        _store_rows(host_ptr, host_row, to_host, kv, KV_WORDS, BLOCK_KV)
    index = _load_rows(index_ptr, src, ok, INDEX_WORDS, BLOCK_INDEX)
    _store_index_rows(
        pool_ptr,
        layer * num_pages + page,
        t % P,
        ok,
        index,
        P,
        INDEX_WORDS,
        SCALE_WORDS,
        BLOCK_INDEX,
    )


def kv_append(
    layer: int,
    kv_rows: torch.Tensor,
    index_rows: torch.Tensor,
    req_slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    req_mode: torch.Tensor,
    page_table: torch.Tensor,
    host_kv: Union[torch.Tensor, UVATensor],
    hot_kv: torch.Tensor,
    index_pool: torch.Tensor,
    *,
    window: int,
    row_format: RowFormat,
    index_format: IndexFormat,
) -> None:
    """Store N new tokens' rows of layer `layer`.

    kv_rows [N, D] uint8 (already encoded: stored as they are), or [N, 576] bf16 encoded here as
    `row_format` says (its Triton variant: bf16 bytes, or DeepSeek-V3.2's fp8 row quantized by
    kernels.store.fp8_row, the same bytes as its reference quantize); D = row_format.row_bytes and
    I = index_format.key_bytes. index_rows [N, I] uint8; req_slots,
    positions, seq_lens [N] int32 (seq_len of the row's request after this append);
    req_mode [R] int32;
    page_table [R, max_pages] int32; host_kv [num_pages, L, P, D] uint8 (its UVATensor on GPU);
    hot_kv [L, R, B, D] uint8; index_pool [L, num_pages, P, I] uint8. D and the index format's
    value and scale bytes multiples of 4. An index row is its values then its scale; in the pool
    a page holds the values of its P tokens, then their P scales (kernels.reference.page_views).
    A row is written only if its slot is in [0, R) with mode 1 or 2, 0 <= position <
    min(seq_len, max_pages * P) and its page is in [0, num_pages); other rows write nothing.
    Launch-only: graph capturable.
    """
    (num_pages, L, P, D), (_, R, B, _), (n, I) = host_kv.shape, hot_kv.shape, index_rows.shape
    if D != row_format.row_bytes or I != index_format.key_bytes:
        raise ValueError(
            f"tiers of {D} B rows and {I} B keys are not {row_format.describe()} rows and "
            f"{index_format.describe()} keys"
        )
    scale_words, scale_rest = divmod(index_format.scale_bytes, 4)
    if D % 4 or I % 4 or scale_rest or not 1 <= window <= B or not 0 <= layer < L:
        raise ValueError(f"bad sizes: D={D} I={I} window={window} B={B} layer={layer} L={L}")
    if hot_kv.is_cuda and isinstance(host_kv, torch.Tensor) and not host_kv.is_cuda:
        raise TypeError("on GPU pass the host tier as a kernels.uva.UVATensor")
    u8, i32 = torch.uint8, torch.int32
    encoded = kv_rows.dtype == u8
    if not encoded and row_format.kernel is None:
        raise ValueError(f"row format {row_format.name} has no Triton kernel: use the references")
    quant = not encoded and row_format.kernel is RowKernel.FP8
    if not encoded and not quant:
        kv_rows = kv_rows.view(u8)
    check_specs(
        {
            "kv_rows": (
                kv_rows,
                torch.bfloat16 if quant else u8,
                (n, ROW_VALUES) if quant else (n, D),
            ),
            "index_rows": (index_rows, u8, (n, I)),
            "req_slots": (req_slots, i32, (n,)),
            "positions": (positions, i32, (n,)),
            "seq_lens": (seq_lens, i32, (n,)),
            "req_mode": (req_mode, i32, (R,)),
            "page_table": (page_table, i32, (R, page_table.shape[1])),
            "host_kv": (host_kv, u8, (num_pages, L, P, D)),
            "hot_kv": (hot_kv, u8, (L, R, B, D)),
            "index_pool": (index_pool, u8, (L, num_pages, P, I)),
        }
    )
    if n == 0:
        return
    _kv_append_kernel[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
        kv_rows,
        index_rows,
        req_slots,
        positions,
        seq_lens,
        req_mode,
        page_table,
        host_kv,
        hot_kv,
        index_pool,
        layer,
        n,
        R,
        B,
        page_table.shape[1],
        num_pages,
        L=L,
        P=P,
        W=window,
        KV_WORDS=D // 4,
        INDEX_WORDS=I // 4,
        SCALE_WORDS=scale_words,
        BLOCK_KV=triton.next_power_of_2(D // 4),
        BLOCK_INDEX=triton.next_power_of_2(I // 4),
        ROWS=ROWS_PER_PROGRAM,
        QUANT=quant,
        num_warps=4,
    )
