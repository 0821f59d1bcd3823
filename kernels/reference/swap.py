"""References of the swap-in: the plan (kernels/swap_plan.py) and the miss copy
(kernels/miss_copy.py). Plan semantics: docs/ARCHITECTURE.md."""

from __future__ import annotations

import torch

from kernels.formats import MODE_OFFLOADED, MODE_RESIDENT


def host_tensor(host):
    """The host tier as a plain tensor: the tensor itself, or the one a UVATensor wraps."""
    return getattr(host, "tensor", host)


def flat_rows(x) -> torch.Tensor:
    t = host_tensor(x)
    return t.view(-1, t.shape[-1])


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
    host, hot = flat_rows(host_rows), flat_rows(hot_rows)
    k = miss_src.shape[1]
    for b, count in enumerate(miss_count.tolist()):
        n = min(max(count, 0), k)
        for src, dst in zip(miss_src[b, :n].tolist(), miss_dst[b, :n].tolist()):
            if 0 <= src < host.shape[0] and 0 <= dst < hot.shape[0]:
                hot[dst] = host[src].to(hot.device)
