"""swap_plan with several rows per request (a speculative verify step's D + 1 rows): one plan
over the union of the rows' top-k. Exact equality with the reference on irregular shapes, and
agreement with the exact-LRU simulator run over the unions (tests/lru_simulator.py)."""

from __future__ import annotations

import random

import pytest
import torch
from lru_simulator import LRUSim

from kernels.reference import ref_swap_plan
from kernels.swap.plan import swap_plan
from tests.kernels.swap.test_swap_plan import (
    DEVICES,
    POISON,
    Cfg,
    State,
    assert_same_plan,
    check_residency,
    fresh_state,
    plan,
    random_row,
    random_state,
)


def plan_group(fn, st: State, layer: int, topk, seq_lens, req_slots, G: int, **extra):
    cfg, dev = st.cfg, st.hit_flag.device
    n = len(topk) // G
    outs = [
        torch.full((len(topk), cfg.k), POISON, dtype=torch.int32, device=dev),
        torch.full((n, G * cfg.k), POISON, dtype=torch.int64, device=dev),
        torch.full((n, G * cfg.k), POISON, dtype=torch.int64, device=dev),
        torch.full((n,), POISON, dtype=torch.int32, device=dev),
        torch.full((n,), POISON, dtype=torch.int32, device=dev),
    ]
    return plan(
        fn,
        st,
        layer,
        topk,
        seq_lens,
        req_slots,
        outs,
        rows_per_request=G,
        out_miss_rows=outs[4],
        **extra,
    )


def plan_group_both(st: State, layer: int, topk, seq_lens, req_slots, G: int):
    """Kernel and reference on copies of one state: identical outputs and state."""
    ref_st = st.clone()
    outs = plan_group(swap_plan, st, layer, topk, seq_lens, req_slots, G)
    ref_outs = plan_group(ref_swap_plan, ref_st, layer, topk, seq_lens, req_slots, G)
    assert_same_plan(st, ref_st, outs, ref_outs)
    return outs


def verify_rows(rng: random.Random, k: int, base: int, G: int, C: int, shared: float):
    """G causal rows of one request (row j has length base + j + 1) that share about `shared`
    of their positions, plus padding and bad values."""
    first = random_row(rng, k, min(base + 1, C), C)
    rows, lens = [first], [base + 1]
    for j in range(1, G):
        n = min(base + j + 1, C)
        keep = [t for t in set(first) if 0 <= t < n and rng.random() < shared]
        fresh = [t for t in random_row(rng, k, n, C) if t not in keep]
        row = (keep + fresh)[:k]
        rng.shuffle(row)
        rows.append(row)
        lens.append(base + j + 1)
    return rows, lens


def assert_rows_read_their_tokens(st: State, layer, r, rows, lens, slots) -> None:
    """No row evicted a slot another row of the step reads: after the plan, every entry's slot
    holds the entry's own position (ring slot t % W, or an LRU slot whose token is t)."""
    W, seq_len = st.cfg.W, max(lens)
    held = st.slot_token[layer, r].tolist()
    for row, n, got in zip(rows, lens, slots):
        for t, s in zip(row, got):
            if not 0 <= t < min(n, st.cfg.C):
                assert s == -1
            elif t >= seq_len - W:
                assert s == t % W
            else:
                assert s >= W and held[s] == t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cfg,G",
    [
        (Cfg(L=2, R=7, B=33, W=3, k=7, P=5, C=61), 2),
        (Cfg(L=3, R=5, B=40, W=4, k=9, P=4, C=53), 4),
        (Cfg(L=1, R=3, B=230, W=5, k=75, P=16, C=700), 3),
    ],
)
def test_grouped_plan_matches_reference(device, cfg, G):
    rng = random.Random(G * 100 + cfg.k)
    torch.manual_seed(G)
    st = random_state(cfg, device, rng)
    # Mostly offloaded requests (the plan's real work), one resident, one free slot.
    st.req_mode.copy_(torch.tensor([1, 0] + [2] * (cfg.R - 2)).roll(G))
    # Half the requests start with nothing in their LRU slots, so their rows share misses.
    st.token_slot[:, ::2] = -1
    st.slot_token[:, ::2] = -1
    n = 5
    slots = rng.sample(range(cfg.R), min(n, cfg.R))
    topk, lens, req = [], [], []
    for g in range(n):
        r = slots[g] if g < len(slots) and rng.random() < 0.85 else -1
        base = rng.choice([rng.randint(0, cfg.k)] + [rng.randint(cfg.k, cfg.C + 2)] * 3)
        rows, row_lens = verify_rows(rng, cfg.k, base, G, cfg.C, rng.choice([0.5, 0.9]))
        topk, lens, req = topk + rows, lens + row_lens, req + [r] * G
    deduped = 0
    for layer in (cfg.L - 1, 0):
        outs = plan_group_both(st, layer, topk, lens, req, G)
        for g in range(n):
            r = req[g * G]
            count, src = outs[3][g].item(), outs[1][g, : outs[3][g].item()].tolist()
            assert len(set(src)) == count <= outs[4][g].item()  # each position copied once
            deduped += outs[4][g].item() - count
            if r < 0:
                assert count == 0
                continue
            check_residency(st, layer, r)
            if st.req_mode[r] == 2:
                rows = slice(g * G, (g + 1) * G)
                assert_rows_read_their_tokens(
                    st, layer, r, topk[rows], lens[rows], outs[0][rows].tolist()
                )
    assert deduped > 0  # some rows shared a missed position


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("G,shared", [(2, 0.5), (4, 0.8)])
def test_grouped_plan_follows_lru_oracle_over_unions(device, G, shared):
    cfg = Cfg(L=2, R=4, B=60, W=4, k=11, P=5, C=160)
    rng = random.Random(G)
    torch.manual_seed(G)
    st = fresh_state(cfg, device, [2, 2, 1, 2])
    req = [3, 0, 2]
    bases = [40, 21, 9]
    sims = {(l, r): LRUSim(cfg.B, cfg.W) for l in range(cfg.L) for r in req}
    deduped = 0
    for _ in range(6):
        # A verify step's rows: positions base..base + G - 1; accepted 0..G - 1 of them.
        bases = [b + rng.randint(1, G) for b in bases]
        for layer in range(cfg.L):
            groups = [verify_rows(rng, cfg.k, b, G, cfg.C, shared) for b in bases]
            topk = [row for rows, _ in groups for row in rows]
            lens = [n for _, row_lens in groups for n in row_lens]
            outs = plan_group_both(st, layer, topk, lens, [r for r in req for _ in range(G)], G)
            for g, (r, (rows, row_lens)) in enumerate(zip(req, groups)):
                if st.req_mode[r] != 2:
                    continue
                per_row, misses, _, row_misses = sims[layer, r].step_union(rows, row_lens)
                assert outs[0][g * G : (g + 1) * G].tolist() == per_row
                assert outs[3][g].item() == len(misses) and outs[4][g].item() == row_misses
                for j, (_, t, v) in enumerate(misses):
                    assert outs[2][g, j].item() == (layer * cfg.R + r) * cfg.B + v
                sim = sims[layer, r]
                assert st.lru_order[layer, r].tolist() == sim.order()
                assert st.slot_token[layer, r].tolist() == [
                    sim.holds.get(s, -1) for s in range(cfg.B)
                ]
                check_residency(st, layer, r)
                deduped += row_misses - len(misses)
    assert deduped > 0  # the rows did share misses


@pytest.mark.parametrize(
    "G,k,W,bs",
    [(2, 11, 3, 4), (3, 7, 3, 4), (5, 4, 6, 5), (2, 7, 1, 4)],
)
def test_grouped_plan_refuses_what_cannot_fit(G, k, W, bs):
    """G must divide the batch, be at most 4 and at most W (the ring holds every row's token),
    and the union G k must fit the LRU slots B - W."""
    cfg = Cfg(L=1, R=4, B=24, W=W, k=k, P=5, C=40)
    st = fresh_state(cfg, "cpu", [2] * cfg.R)
    with pytest.raises(ValueError):
        plan_group(swap_plan, st, 0, [[-1] * k] * bs, [1] * bs, [0] * bs, G)
