"""Plain-PyTorch references for every kernel in this package.

Each `ref_*` computes the same function as its kernel, written for clarity rather than speed.
Tests compare kernels against these on random inputs of irregular sizes.
"""

from __future__ import annotations

import torch

from kernels.formats import (
    BF16_ROW,
    FP8_ROW,
    MODE_OFFLOADED,
    MODE_RESIDENT,
    IndexFormat,
    RowFormat,
)

# --- swap-in: plan, miss copy, append (kernels/swap_plan.py, miss_copy.py, kv_append.py) ---


def _host_tensor(host):
    """The host tier as a plain tensor: the tensor itself, or the one a UVATensor wraps."""
    return getattr(host, "tensor", host)


def _flat_rows(x) -> torch.Tensor:
    t = _host_tensor(x)
    return t.view(-1, t.shape[-1])


# --- index-key pool layout (written by kv_append, read by the indexer) ---


def page_views(pool: torch.Tensor, fmt: IndexFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (values [..., N, P, value_bytes], scales [..., N, P, scale_bytes]) of an index pool
    [..., N, P, key_bytes] whose last two dims are contiguous: a page holds its P keys' values,
    then their P scales (kernels.formats). Writing into them writes the pool."""
    P, V = pool.shape[-2], fmt.value_bytes
    flat = pool.view(*pool.shape[:-2], P * fmt.key_bytes)
    return (
        flat[..., : P * V].unflatten(-1, (P, V)),
        flat[..., P * V :].unflatten(-1, (P, fmt.scale_bytes)),
    )


def read_index_rows(
    pool: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, fmt: IndexFormat
) -> torch.Tensor:
    """Append-format rows [n, I] of tokens (pages[i], offs[i]) of an index pool [N, P, I]."""
    values, scales = page_views(pool, fmt)
    return torch.cat((values[pages, offs], scales[pages, offs]), dim=-1)


def write_index_rows(
    pool: torch.Tensor,
    pages: torch.Tensor,
    offs: torch.Tensor,
    rows: torch.Tensor,
    fmt: IndexFormat,
) -> None:
    """Store append-format rows [n, I] at tokens (pages[i], offs[i]) of an index pool [N, P, I]
    (plain tensor indexing: no host sync, graph-capturable on CUDA)."""
    values, scales = page_views(pool, fmt)
    values[pages, offs] = rows[..., : fmt.value_bytes]
    scales[pages, offs] = rows[..., fmt.value_bytes :]


def _ref_plan_request(
    layer, r, row, seq_len, pages, token_slot, slot_token, lru_order, num_layers, page_size, window
):
    """Plan one offloaded (layer, request); returns (slots, [(host row, hot row)] per miss)."""
    _, R, C = token_slot.shape
    B, W, P = slot_token.shape[2], window, page_size
    ts, st = token_slot[layer, r].tolist(), slot_token[layer, r].tolist()
    order = lru_order[layer, r].tolist()
    slots, hits, missed = [], set(), []
    for i, t in enumerate(row):
        slots.append(-1)
        if not 0 <= t < seq_len:
            continue
        if t >= seq_len - W:
            slots[i] = t % W
        elif W <= ts[t] < B:
            slots[i] = ts[t]
            hits.add(ts[t])
        elif pages[t // P] >= 0:
            missed.append(i)
    free = [s for s in order if s not in hits]
    missed = missed[: len(free)]
    victims = free[: len(missed)]
    kept = free[len(missed) :]
    lru_order[layer, r] = torch.tensor(kept + [s for s in order if s in hits] + victims)
    for v in victims:
        if 0 <= v < B and 0 <= st[v] < C:
            ts[st[v]] = -1
    misses = []
    for i, v in zip(missed, victims):
        t = row[i]
        slots[i], ts[t] = v, v
        if 0 <= v < B:
            st[v] = t
        misses.append(((pages[t // P] * num_layers + layer) * P + t % P, (layer * R + r) * B + v))
    token_slot[layer, r] = torch.tensor(ts)
    slot_token[layer, r] = torch.tensor(st)
    return slots, misses


def ref_swap_plan(
    layer,
    topk,
    seq_lens,
    req_slots,
    req_mode,
    page_table,
    token_slot,
    slot_token,
    lru_order,
    hit_flag,
    out_slots,
    out_miss_src,
    out_miss_dst,
    out_miss_count,
    *,
    num_layers,
    page_size,
    window,
):
    """Reference of kernels.swap_plan.swap_plan (hit_flag is not needed here: left untouched)."""
    _, R, C = token_slot.shape
    B = slot_token.shape[2]
    rows = zip(topk.tolist(), seq_lens.tolist(), req_slots.tolist())
    for b, (row, seq_len, r) in enumerate(rows):
        mode = int(req_mode[r]) if 0 <= r < R else 0
        seq_len = min(max(seq_len, 0), C)
        misses = []
        if mode == MODE_OFFLOADED:
            slots, misses = _ref_plan_request(
                layer,
                r,
                row,
                seq_len,
                page_table[r].tolist(),
                token_slot,
                slot_token,
                lru_order,
                num_layers,
                page_size,
                window,
            )
        else:
            slots = [t if mode == MODE_RESIDENT and 0 <= t < min(seq_len, B) else -1 for t in row]
        out_slots[b] = torch.tensor(slots, dtype=torch.int32)
        for j, (src, dst) in enumerate(misses):
            out_miss_src[b, j] = src
            out_miss_dst[b, j] = dst
        out_miss_count[b] = len(misses)


def ref_miss_copy(host_rows, hot_rows, miss_src, miss_dst, miss_count):
    """Reference of kernels.miss_copy.miss_copy: rows out of either tier's range are skipped."""
    host, hot = _flat_rows(host_rows), _flat_rows(hot_rows)
    k = miss_src.shape[1]
    for b, count in enumerate(miss_count.tolist()):
        n = min(max(count, 0), k)
        for src, dst in zip(miss_src[b, :n].tolist(), miss_dst[b, :n].tolist()):
            if 0 <= src < host.shape[0] and 0 <= dst < hot.shape[0]:
                hot[dst] = host[src].to(hot.device)


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
    """Reference of kernels.kv_append.kv_append."""
    host = _host_tensor(host_kv)
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


# --- end swap-in ---

# --- KV rows as the tiers store them (kernels.formats owns each format's codec) ---


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
    """Reference of kernels.fp8_row.kv_quantize, for any format with a quantize function."""
    if row_format.quantize is None:
        raise ValueError(f"row format {row_format.name} stores rows unencoded")
    row_format.quantize(rows, out)


# --- end fp8 KV rows ---


# --- attention and indexer (owned by kernels/sparse_attention.py, indexer.py) ---


def ref_sparse_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_base: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    row_format: RowFormat = BF16_ROW,
    workspace=None,
) -> None:
    """Absorbed MLA decode over the rows `row_base[b] + slots[b, i]` (slot < 0 skipped), fp64 math.
    kv: rows as `row_format` has attention read them (bf16 values, or stored bytes that its
    dequantize decodes first). `workspace` (the kernel's split-k scratch) is accepted and unused."""
    d_v = q_nope.shape[-1]
    valid = slots >= 0
    rows = torch.where(valid, row_base[:, None] + slots.long(), 0)
    decode = row_format.dequantize
    picked = kv[rows] if decode is None else decode(kv[rows])
    k = torch.where(valid[..., None], picked.double(), 0.0)  # [bs, k, 576]
    q = torch.cat([q_nope, q_pe], dim=-1).double()  # [bs, H, 576]
    s = scale * torch.einsum("bhd,bkd->bhk", q, k)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse_d = torch.logsumexp(s, dim=-1)  # -inf for rows with no valid slot
    p = torch.exp(s - torch.where(torch.isinf(lse_d), 0.0, lse_d)[..., None])
    out.copy_(torch.einsum("bhk,bkd->bhd", p, k[..., :d_v]))
    lse.copy_(lse_d)


def ref_indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool_layer: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    out_scores: torch.Tensor,
    *,
    index_format: IndexFormat,
) -> None:
    """score[b, t] = sum_h w[b, h] * relu(q[b, h] . key_t) for t < seq_len, else -inf (fp64 math).
    A padding row (req_slot < 0), a token whose page id is < 0 or beyond the page table score
    -inf."""
    page = index_pool_layer.shape[1]
    out_scores.fill_(float("-inf"))
    for b in range(q.shape[0]):
        r = int(req_slots[b])
        n = min(int(seq_lens[b]), out_scores.shape[1], page_table.shape[1] * page)
        if r < 0 or n <= 0:
            continue
        t = torch.arange(n, device=q.device)
        pages = page_table[r, t // page].long()
        ok = pages >= 0
        rows = read_index_rows(index_pool_layer, pages.clamp(min=0), t % page, index_format)
        keys = index_format.decode(rows).double()
        s = torch.relu(q[b].double() @ keys.T)  # [64, n]
        score = w[b].double() @ s
        out_scores[b, :n] = torch.where(ok, score, float("-inf")).to(out_scores.dtype)


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """int32 image of fp32 scores whose signed order is the score order; NaN counts as -inf and
    -0.0 as +0.0, so equal scores have equal keys."""
    x = torch.nan_to_num(
        scores.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")
    )
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def ref_topk_select(
    scores: torch.Tensor, seq_lens: torch.Tensor, out_topk: torch.Tensor, *, workspace=None
) -> None:
    """The k = out_topk.shape[1] highest scores among positions < seq_len, ties to the lower
    position, in ascending position order, padded with -1 (`workspace` accepted, unused)."""
    k = out_topk.shape[1]
    out_topk.fill_(-1)
    for b in range(scores.shape[0]):
        n = max(0, min(int(seq_lens[b]), scores.shape[1]))
        if n == 0:
            continue
        pos = torch.arange(n, dtype=torch.int64, device=scores.device)
        key = order_key(scores[b, :n]).long() * (1 << 32) + ((1 << 32) - 1 - pos)
        top = torch.topk(key, min(k, n)).values
        picked = torch.sort((1 << 32) - 1 - (top & 0xFFFFFFFF)).values
        out_topk[b, : picked.numel()] = picked.to(out_topk.dtype)


# --- end attention and indexer ---
