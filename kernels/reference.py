"""Plain-PyTorch references for every kernel in this package.

Each `ref_*` computes the same function as its kernel, written for clarity rather than speed.
Tests compare kernels against these on random inputs of irregular sizes.
"""

from __future__ import annotations

import torch

# --- swap-in: plan, miss copy, append (kernels/swap_plan.py, miss_copy.py, kv_append.py) ---


def _host_tensor(host):
    """The host tier as a plain tensor: the tensor itself, or the one a UVATensor wraps."""
    return getattr(host, "tensor", host)


def _flat_rows(x) -> torch.Tensor:
    t = _host_tensor(x)
    return t.view(-1, t.shape[-1])


# --- index-key pool layout (written by kv_append, read by the indexer) ---

# fp8 index keys are page-blocked in the pool (DeepSeek-V3.2's indexer cache layout): the bytes of
# a page of P tokens are [P x 128 fp8 values | P x 4 B fp32 scales], so every token's values start
# 16 B aligned (when P % 4 == 0). The pool keeps its [..., N, P, 132] byte shape; bf16 keys (and
# any other row size) are stored row by row. Appends take rows of 128 values + scale either way.
FP8_KEY_BYTES = 132


def fp8_page_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (values [..., N, P, 128], scales [..., N, P, 4]) of an fp8 index pool [..., N, P, 132]
    whose last two dims are contiguous; writing into them writes the pool."""
    P = pool.shape[-2]
    flat = pool.view(*pool.shape[:-2], P * FP8_KEY_BYTES)
    return (
        flat[..., : P * 128].unflatten(-1, (P, 128)),
        flat[..., P * 128 :].unflatten(-1, (P, 4)),
    )


def read_index_rows(pool: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Append-format rows [n, I] of tokens (pages[i], offs[i]) of an index pool [N, P, I]."""
    if pool.shape[-1] != FP8_KEY_BYTES:
        return pool[pages, offs]
    values, scales = fp8_page_views(pool)
    return torch.cat((values[pages, offs], scales[pages, offs]), dim=-1)


def write_index_rows(
    pool: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor
) -> None:
    """Store append-format rows [n, I] at tokens (pages[i], offs[i]) of an index pool [N, P, I]
    (plain tensor indexing: no host sync, graph-capturable on CUDA)."""
    if pool.shape[-1] != FP8_KEY_BYTES:
        pool[pages, offs] = rows
        return
    values, scales = fp8_page_views(pool)
    values[pages, offs] = rows[..., :128]
    scales[pages, offs] = rows[..., 128:]


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
        if mode == 2:
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
            slots = [t if mode == 1 and 0 <= t < min(seq_len, B) else -1 for t in row]
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
):
    """Reference of kernels.kv_append.kv_append."""
    host = _host_tensor(host_kv)
    num_pages, _, P, _ = host.shape
    R, B = hot_kv.shape[1], hot_kv.shape[2]
    limit = page_table.shape[1] * P
    kv_rows = kv_rows_for_store(kv_rows, host.shape[-1])
    rows = zip(req_slots.tolist(), positions.tolist(), seq_lens.tolist())
    for i, (r, t, seq_len) in enumerate(rows):
        mode = int(req_mode[r]) if 0 <= r < R else 0
        if mode not in (1, 2) or not 0 <= t < min(seq_len, limit):
            continue
        page = int(page_table[r, t // P])
        if not 0 <= page < num_pages:
            continue
        at = torch.tensor([[page], [t % P]], device=index_pool.device)
        write_index_rows(
            index_pool[layer], at[0], at[1], index_rows[i : i + 1].to(index_pool.device)
        )
        if mode == 1 and t < B:
            hot_kv[layer, r, t] = kv_rows[i]
        if mode == 2:
            host[page, layer, t % P] = kv_rows[i].to(host.device)
            if t >= seq_len - window:
                hot_kv[layer, r, t % window] = kv_rows[i]


# --- end swap-in ---

# --- fp8 KV rows (written by kv_append.py, read by sparse_attention.py) ---

# DeepSeek-V3.2's FlashMLA fp8 row (656 B): bytes [0, 512) are the 512 latent values as fp8 e4m3,
# [512, 528) four fp32 scales (one per 128 latent values), [528, 656) the 64 rope values as bf16.
FP8_ROW_BYTES = 656
FP8_MAX = 448.0
# Rows whose 128-value block is all (near) zero still get a finite scale.
FP8_AMAX_FLOOR = 1e-4


def fp8_block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) fp32 of per-block maxima: scale = 2^ceil(log2(max(amax, 1e-4) / 448)),
    the smallest power of two with amax / scale <= 448. Powers of two make x / scale and the
    dequantized fp8 * scale exact, so every implementation gets the same bytes and bf16 values."""
    bits = amax.float().clamp(min=FP8_AMAX_FLOOR).view(torch.int32)
    # amax = m * 2^e, m in [1, 2): amax / 448 = (m / 1.75) * 2^(e - 8).
    s = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return ((s + 127) << 23).view(torch.float32), ((127 - s) << 23).view(torch.float32)


def ref_quantize_kv_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """rows [n, 576] (bf16, or any float: rounded to bf16 first) -> out [n, 656] uint8 fp8 rows.
    Values x / scale are clamped to +-448 and rounded to nearest even by the fp8 cast."""
    n = rows.shape[0]
    x = rows.to(torch.bfloat16).float()
    nope = x[:, :512].reshape(n, 4, 128)
    scale, inv = fp8_block_scales(nope.abs().amax(dim=-1))
    q = (nope * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out[:, :512] = q.view(torch.uint8).reshape(n, 512)
    out[:, 512:528] = scale.contiguous().view(torch.uint8)
    out[:, 528:] = x[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8)


def ref_dequantize_kv_rows(raw: torch.Tensor) -> torch.Tensor:
    """fp8 rows [..., 656] uint8 -> [..., 576] bf16 (exact: fp8 * a power of two fits bf16)."""
    raw = raw.contiguous()
    lead = raw.shape[:-1]
    q = raw[..., :512].view(torch.float8_e4m3fn).float().reshape(*lead, 4, 128)
    scale = raw[..., 512:528].contiguous().view(torch.float32)
    nope = (q * scale[..., None]).reshape(*lead, 512)
    rope = raw[..., 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1).to(torch.bfloat16)


def kv_rows_for_store(kv_rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Rows as the tiers store them ([n, row_bytes] uint8): bf16 [n, 576] rows are quantized for
    fp8 tiers (656 B) or taken as bytes for bf16 tiers; uint8 rows are stored as they are."""
    if kv_rows.dtype == torch.uint8:
        return kv_rows
    if row_bytes == FP8_ROW_BYTES:
        out = torch.empty(
            (kv_rows.shape[0], FP8_ROW_BYTES), dtype=torch.uint8, device=kv_rows.device
        )
        ref_quantize_kv_rows(kv_rows, out)
        return out
    return kv_rows.to(torch.bfloat16).contiguous().view(torch.uint8)


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
    workspace=None,
) -> None:
    """Absorbed MLA decode over the rows `row_base[b] + slots[b, i]` (slot < 0 skipped), fp64 math.
    kv: bf16 [rows, 576] or fp8 rows [rows, 656] uint8 (dequantized first). `workspace` (the
    kernel's split-k scratch) is accepted and unused."""
    d_v = q_nope.shape[-1]
    valid = slots >= 0
    rows = torch.where(valid, row_base[:, None] + slots.long(), 0)
    picked = ref_dequantize_kv_rows(kv[rows]) if kv.dtype == torch.uint8 else kv[rows]
    k = torch.where(valid[..., None], picked.double(), 0.0)  # [bs, k, 576]
    q = torch.cat([q_nope, q_pe], dim=-1).double()  # [bs, H, 576]
    s = scale * torch.einsum("bhd,bkd->bhk", q, k)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse_d = torch.logsumexp(s, dim=-1)  # -inf for rows with no valid slot
    p = torch.exp(s - torch.where(torch.isinf(lse_d), 0.0, lse_d)[..., None])
    out.copy_(torch.einsum("bhk,bkd->bhd", p, k[..., :d_v]))
    lse.copy_(lse_d)


def decode_index_keys(raw: torch.Tensor) -> torch.Tensor:
    """Index-key rows [..., I] in append format to fp32 keys [..., 128]: I=256 is bf16, I=132 is
    128 fp8 e4m3 values then one fp32 scale."""
    if raw.shape[-1] == 256:
        return raw.contiguous().view(torch.bfloat16).float()
    if raw.shape[-1] == FP8_KEY_BYTES:
        raw = raw.contiguous()
        vals = raw[..., :128].view(torch.float8_e4m3fn).float()
        return vals * raw[..., 128:].view(torch.float32)
    raise ValueError(f"index key of {raw.shape[-1]} bytes is neither bf16 (256) nor fp8 (132)")


def ref_indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool_layer: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    out_scores: torch.Tensor,
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
        rows = read_index_rows(index_pool_layer, pages.clamp(min=0), t % page)
        keys = decode_index_keys(rows).double()
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
