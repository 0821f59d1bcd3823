"""References of the swap-in: the plan (kernels/swap/plan.py) and the miss copy
(kernels/swap/miss_copy.py). Plan semantics: docs/ARCHITECTURE.md."""

from __future__ import annotations

import torch

from kernels.formats import MODE_OFFLOADED, MODE_RESIDENT
from kernels.reference.shared_swap import shared_copies, shared_phase


def host_tensor(host):
    """The host tier as a plain tensor: the tensor itself, or the one a UVATensor wraps."""
    return getattr(host, "tensor", host)


def flat_rows(x) -> torch.Tensor:
    t = host_tensor(x)
    return t.view(-1, t.shape[-1])


def _lookup(entries, seq_len, ts, pages, B, W, P):
    """Slots of the window and LRU hits; the entries that miss (first occurrences) and the
    repeats of a missed position."""
    slots: list[int] = []
    missed: list[int] = []
    repeats: list[int] = []
    hits, first = set(), set()
    for i, (t, row_len) in enumerate(entries):
        slots.append(-1)
        if not 0 <= t < row_len:
            continue
        if t >= seq_len - W:
            slots[i] = t % W
        elif W <= ts[t] < B:
            slots[i] = ts[t]
            hits.add(ts[t])
        elif pages[t // P] >= 0:
            (repeats if t in first else missed).append(i)
            first.add(t)
    return slots, hits, missed, repeats


def _no_victim(entries, slots, ts, unplaced, repeats, host):
    """The misses without a victim give their claim back (token_slot -1); with `host` (a
    position's flat host row: host_fallback) their entries read -2 - that row. Repeats read
    their first occurrence's slot, or, when it got none (-1), the host row too."""
    for i in unplaced:
        t = entries[i][0]
        ts[t] = -1
        if host is not None:
            slots[i] = -2 - host(t)
    for i in repeats:
        t = entries[i][0]
        slots[i] = -2 - host(t) if host is not None and ts[t] == -1 else ts[t]


def _ref_plan_request(
    layer, r, entries, seq_len, pages, token_slot, slot_token, lru_order, num_layers, P, W,
    host_fallback=False,
):  # fmt: skip
    """Plan one offloaded (layer, request) over entries [(position, its row's length)];
    returns (slots, [(host row, hot row)] per miss, misses summed over rows, missed positions
    read from the host: with host_fallback, those without a victim, whose entries read
    -2 - host row)."""
    _, R, C = token_slot.shape
    B = slot_token.shape[2]
    ts, st = token_slot[layer, r].tolist(), slot_token[layer, r].tolist()
    order = lru_order[layer, r].tolist()
    slots, hits, missed, repeats = _lookup(entries, seq_len, ts, pages, B, W, P)
    host = lambda t: (pages[t // P] * num_layers + layer) * P + t % P  # noqa: E731
    row_misses = len(missed) + len(repeats)
    free = [s for s in order if s not in hits]
    placed, unplaced = missed[: len(free)], missed[len(free) :]
    victims = free[: len(placed)]
    kept = free[len(placed) :]
    lru_order[layer, r] = torch.tensor(kept + [s for s in order if s in hits] + victims)
    for v in victims:
        if 0 <= v < B and 0 <= st[v] < C:
            ts[st[v]] = -1
    misses = []
    for i, v in zip(placed, victims):
        t = entries[i][0]
        slots[i], ts[t] = v, v
        if 0 <= v < B:
            st[v] = t
        misses.append((host(t), (layer * R + r) * B + v))
    _no_victim(entries, slots, ts, unplaced, repeats, host if host_fallback else None)
    token_slot[layer, r] = torch.tensor(ts)
    slot_token[layer, r] = torch.tensor(st)
    return slots, misses, row_misses, len(unplaced) if host_fallback else 0


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
    rows_per_request=1,
    out_miss_rows=None,
    out_counts=None,
    out_totals=None,
    shared=None,
    host_fallback=False,
):
    """Reference of kernels.swap.plan.swap_plan (hit_flag is not needed here: left untouched).
    host_fallback: misses past the victims read their host row (-2 - row), as the kernel's.
    With `shared` (contract.shared_region.SharedRegion), the cached-prefix rows of offloaded
    requests go through the shared region first (kernels/reference/shared_swap.py)."""
    _, R, C = token_slot.shape
    B, G, k = slot_token.shape[2], rows_per_request, topk.shape[1]
    rows, lens, req = topk.tolist(), seq_lens.tolist(), req_slots.tolist()
    groups = []
    for g in range(len(rows) // G):
        r = req[g * G]
        mode = int(req_mode[r]) if 0 <= r < R else 0
        row_lens = [min(max(n, 0), C) for n in lens[g * G : (g + 1) * G]]
        entries = [(t, n) for row, n in zip(rows[g * G : (g + 1) * G], row_lens) for t in row]
        groups.append((r, mode, row_lens, entries))
    served = shared_phase(layer, groups, shared, token_slot, page_table, page_size, window)
    for g, (r, mode, row_lens, entries) in enumerate(groups):
        misses, row_misses, host_reads = [], 0, 0
        if mode == MODE_OFFLOADED:
            private = [(-1, n) if s >= 0 else (t, n) for (t, n), s in zip(entries, served[g][0])]
            slots, misses, row_misses, host_reads = _ref_plan_request(
                layer,
                r,
                private,
                max(row_lens),
                page_table[r].tolist(),
                token_slot,
                slot_token,
                lru_order,
                num_layers,
                page_size,
                window,
                host_fallback,
            )
            dims = (num_layers, R, B, page_size)
            pages = page_table[r].tolist()
            copies = shared_copies(layer, r, shared, entries, slots, served[g], pages, dims)
            misses, row_misses = misses + copies, row_misses + len(copies)
        else:
            resident = mode == MODE_RESIDENT
            slots = [t if resident and 0 <= t < min(n, B) else -1 for t, n in entries]
        out_slots[g * G : (g + 1) * G] = torch.tensor(slots, dtype=torch.int32).view(G, k)
        for j, (src, dst) in enumerate(misses):
            out_miss_src[g, j] = src
            out_miss_dst[g, j] = dst
        out_miss_count[g] = len(misses)
        if out_miss_rows is not None:
            out_miss_rows[g] = row_misses
        rows_g = rows[g * G : (g + 1) * G]
        # Host reads are misses to the counters (missed positions, copied or not).
        missed = len(misses) + host_reads
        _add_counts(out_counts, out_totals, req[g * G : (g + 1) * G], rows_g, missed, row_misses)


def _add_counts(counts, totals, req, rows, misses, row_misses):
    """The plan's counters: each row's entries >= 0 at its own request slot (row R for
    padding), the request's copies at its first row's slot."""
    selected = [sum(t >= 0 for t in row) for row in rows]
    if totals is not None:
        totals[0] += sum(selected)
        totals[1] += misses
    if counts is not None:
        R = counts.shape[0] - 1
        at = [r if 0 <= r < R else R for r in req]
        for r, n in zip(at, selected):
            counts[r, 0] += n
        counts[at[0], 1] += misses
        counts[at[0], 2] += row_misses


def _flat_work(miss_src, miss_dst, miss_count):
    """(flat row, src, dst) of the miss copy's flat work list: every request's list clamped to
    [0, k], one after another."""
    k, f = miss_src.shape[1], 0
    for b, count in enumerate(miss_count.tolist()):
        n = min(max(count, 0), k)
        for src, dst in zip(miss_src[b, :n].tolist(), miss_dst[b, :n].tolist()):
            yield f, src, dst
            f += 1


def ref_miss_copy(host_rows, hot_rows, miss_src, miss_dst, miss_count, landing=None):
    """Reference of kernels.swap.miss_copy.miss_copy: rows out of either tier's range are
    skipped; flat work rows below landing's row count come from landing (the staged copy)."""
    host, hot = flat_rows(host_rows), flat_rows(hot_rows)
    landed = 0 if landing is None else landing.shape[0]
    for f, src, dst in _flat_work(miss_src, miss_dst, miss_count):
        if 0 <= src < host.shape[0] and 0 <= dst < hot.shape[0]:
            hot[dst] = (landing[f] if f < landed else host[src]).to(hot.device)


def ref_host_gather(host_rows, src, count, staging, first=0, last=None):
    """Reference of kernels.swap.host_gather.host_gather: staging[f] = the host row of flat
    work row f, f in [first, min(last, budget)); sources outside the tier are skipped."""
    host = host_rows.view(-1, staging.shape[1])
    last = staging.shape[0] if last is None else min(last, staging.shape[0])
    for f, s, _ in _flat_work(src, src, count):
        if first <= f < last and 0 <= s < host.shape[0]:
            staging[f] = host[s]
