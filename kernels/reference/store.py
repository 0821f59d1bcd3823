"""Reference of the KV append (kernels/store/append.py) and of the row encoding the tiers store
(kernels/store/fp8_row.py's kv_quantize; each format's codec is in kernels.formats)."""

from __future__ import annotations

import torch

from kernels.formats import FP8_ROW, MODE_OFFLOADED, MODE_RESIDENT, IndexFormat, RowFormat
from kernels.reference.index_pool import write_index_rows
from kernels.reference.swap import host_tensor


def ref_kv_append(
    layer,
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
    *,
    window,
    row_format: RowFormat,
    index_format: IndexFormat,
):
    """Reference of kernels.store.append.kv_append."""
    host = host_tensor(host_kv)
    num_pages, _, P, _ = host.shape
    R, B = hot_kv.shape[1], hot_kv.shape[2]
    limit = page_table.shape[1] * P
    kv_rows = kv_rows_for_store(kv_rows, row_format)
    rows = zip(req_slots.tolist(), positions.tolist(), seq_lens.tolist())
    for i, (r, t, seq_len) in enumerate(rows):
        mode = int(req_mode[r]) if 0 <= r < R else 0
        if mode not in (MODE_RESIDENT, MODE_OFFLOADED) or not 0 <= t < min(seq_len, limit):
            continue
        page = int(page_table[r, t // P])
        if not 0 <= page < num_pages:
            continue
        at = torch.tensor([[page], [t % P]], device=index_pool.device)
        rows_i = index_rows[i : i + 1].to(index_pool.device)
        write_index_rows(index_pool[layer], at[0], at[1], rows_i, index_format)
        if mode == MODE_RESIDENT and t < B:
            hot_kv[layer, r, t] = kv_rows[i]
        if mode == MODE_OFFLOADED:
            host[page, layer, t % P] = kv_rows[i].to(host.device)
            if t >= seq_len - window:
                hot_kv[layer, r, t % window] = kv_rows[i]


def kv_rows_for_store(kv_rows: torch.Tensor, row_format: RowFormat) -> torch.Tensor:
    """Rows as the tiers store them ([n, row_bytes] uint8): bf16 [n, 576] rows are encoded by
    the format's quantize (or taken as their bytes when it has none); uint8 rows are already
    encoded and stored as they are."""
    if kv_rows.dtype == torch.uint8:
        return kv_rows
    if row_format.quantize is None:
        return kv_rows.to(torch.bfloat16).contiguous().view(torch.uint8)
    out = torch.empty(
        (kv_rows.shape[0], row_format.row_bytes), dtype=torch.uint8, device=kv_rows.device
    )
    row_format.quantize(kv_rows, out)
    return out


def ref_kv_quantize(
    rows: torch.Tensor, out: torch.Tensor, *, row_format: RowFormat = FP8_ROW
) -> None:
    """Reference of kernels.store.fp8_row.kv_quantize, for any format with a quantize function."""
    if row_format.quantize is None:
        raise ValueError(f"row format {row_format.name} stores rows unencoded")
    row_format.quantize(rows, out)
