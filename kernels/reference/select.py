"""References of the top-k selection: the lightning-indexer scores (kernels/select/indexer.py), the
top-k of them (kernels/select/topk.py) and the baseline's pool rows of a selection
(kernels/select/page_rows.py)."""

from __future__ import annotations

import torch

from kernels.formats import IndexFormat
from kernels.reference.index_pool import read_index_rows


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
    query_fp8: bool = False,
) -> None:
    """score[b, t] = sum_h w[b, h] * relu(q[b, h] . key_t) for t < seq_len, else -inf (fp64 math).
    A padding row (req_slot < 0), a token whose page id is < 0 or beyond the page table score
    -inf. query_fp8: q as the fp8 indexer scores it (fp8_query_values)."""
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
        qb = fp8_query_values(q[b]) if query_fp8 else q[b].double()
        s = torch.relu(qb @ keys.T)  # [64, n]
        score = w[b].double() @ s
        out_scores[b, :n] = torch.where(ok, score, float("-inf")).to(out_scores.dtype)


def fp8_query_values(q: torch.Tensor) -> torch.Tensor:
    """q [heads, D] as the fp8 indexer uses it (kernels/select/index_query.py:fp8_query), in
    fp64: per head, scaled by 2^-e with e the least integer such that max |q| * 2^-e <= 448,
    cast to e4m3 (round to nearest even), scaled back by 2^e."""
    qf = q.float()
    amax = qf.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny).double()
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-126, 126)  # exact in fp64 at these sizes
    scaled = (qf.double() * torch.exp2(-e)[:, None]).float().to(torch.float8_e4m3fn)
    return scaled.double() * torch.exp2(e)[:, None]


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


def ref_page_rows(
    topk: torch.Tensor,
    req_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """kernels.select.page_rows.page_rows: the pool row of each top-k position through the
    page table (request slot and page column clamped into the table), -1 for t < 0 or an
    unmapped page; counts[slot (R for padding rows and slots past the table), 0] += the row's
    positions t >= 0."""
    R, ppr = page_table.shape
    t = topk.long()
    table = page_table[req_slots.long().clamp(0, R - 1)]
    col = (t.clamp(min=0) // page_size).clamp(max=ppr - 1)
    page = table.gather(1, col).long()
    rows = page * page_size + t.clamp(min=0) % page_size
    out.copy_(torch.where((t >= 0) & (page >= 0), rows, -1).to(torch.int32))
    if counts is not None:
        idx = torch.where((req_slots >= 0) & (req_slots < R), req_slots, R).long()
        counts[:, 0].index_add_(0, idx, (topk >= 0).sum(dim=1))
