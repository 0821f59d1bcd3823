"""Top-k rows that repeat positions (issue 37 item 3): harmless. Every copy of a position gets the
same slot, a missed position gets one victim and is copied once, the residency stays a bijection,
and the plan is the reference's and the exact-LRU simulator's, the same bytes run after run."""

from __future__ import annotations

import random

import pytest
import torch
from lru_simulator import LRUSim

from kernels.reference import ref_swap_plan
from kernels.swap.plan import swap_plan
from tests.kernels.swap.test_swap_plan import (
    DEVICES,
    STATE,
    Cfg,
    assert_same_plan,
    check_residency,
    fresh_state,
    random_state,
)
from tests.kernels.swap.test_swap_plan_union import plan_group

SMALL = Cfg(L=2, R=5, B=29, W=3, k=11, P=5, C=67)
# On the GPU: a k of 257 spreads one request's entries over all the program's threads.
LARGE = Cfg(L=1, R=6, B=600, W=64, k=257, P=64, C=3001)


def repeating_row(rng: random.Random, k: int, seq_len: int, C: int) -> list[int]:
    """k entries drawn from a few positions (old ones, window ones), so most repeat, mixed with
    padding and bad values."""
    few = rng.sample(range(seq_len), min(seq_len, max(2, k // 4))) if seq_len > 0 else []
    bad = [-1, -1, -3, seq_len, C, 2**31 - 1, -(2**31)]
    return [rng.choice(few) if few and rng.random() < 0.8 else rng.choice(bad) for _ in range(k)]


def batch(rng: random.Random, cfg: Cfg, bs: int):
    # A request is planned by one program per launch (two programs of one request would race on
    # its residency on a GPU, where programs run at once): distinct slots, the rest padding.
    slots = rng.sample(range(cfg.R), min(bs, cfg.R))
    req = slots + [-1] * (bs - len(slots))
    rng.shuffle(req)
    lens = [rng.randint(0, cfg.C + 2) for _ in range(bs)]
    return [repeating_row(rng, cfg.k, min(n, cfg.C), cfg.C) for n in lens], lens, req


def assert_each_position_once(st, layer, topk, lens, req, outs) -> None:
    """Copies of one position read one slot that holds it; each missed position is copied once."""
    W = st.cfg.W
    for b, (row, n, r) in enumerate(zip(topk, lens, req)):
        count = outs[3][b].item()
        src = outs[1][b, :count].tolist()
        assert len(set(src)) == count <= outs[4][b].item()
        if r < 0 or st.req_mode[r] != 2:
            continue
        check_residency(st, layer, r)
        held, slot_of = st.slot_token[layer, r].tolist(), {}
        for t, s in zip(row, outs[0][b].tolist()):
            if 0 <= t < min(n, st.cfg.C):
                assert slot_of.setdefault(t, s) == s and (s < W or held[s] == t), (t, s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [SMALL, Cfg(L=1, R=4, B=40, W=5, k=9, P=4, C=53)])
def test_repeats_match_reference(device, cfg):
    rng = random.Random(cfg.k)
    torch.manual_seed(cfg.k)
    st = random_state(cfg, device, rng)  # residents: repeated hits; free slots: repeated misses
    deduped = 0
    for step in range(4):
        topk, lens, req = batch(rng, cfg, 7)
        ref_st = st.clone()
        layer = step % cfg.L
        outs = plan_group(swap_plan, st, layer, topk, lens, req, 1)
        assert_same_plan(
            st, ref_st, outs, plan_group(ref_swap_plan, ref_st, layer, topk, lens, req, 1)
        )
        assert_each_position_once(st, layer, topk, lens, req, outs)
        deduped += int((outs[4] - outs[3]).sum())
    assert deduped > 0


@pytest.mark.parametrize("device", DEVICES)
def test_repeats_follow_lru_simulator(device):
    cfg = SMALL
    rng = random.Random(5)
    st = fresh_state(cfg, device, [2, 2, 1, 2, 0])
    req, lens = [3, 0, -1, 1], [20, 9, 30, 50]
    sims = {r: LRUSim(cfg.B, cfg.W) for r in (3, 0, 1)}
    hits = 0
    for _ in range(6):
        lens = [min(n + rng.randint(0, 2), cfg.C) for n in lens]
        topk = [repeating_row(rng, cfg.k, n, cfg.C) for n in lens]
        outs = plan_group(swap_plan, st, 1, topk, lens, req, 1)
        for b, (r, row, n) in enumerate(zip(req, topk, lens)):
            if r < 0:
                continue
            slots, misses, _ = sims[r].step(row, n)
            assert outs[0][b].tolist() == slots and outs[3][b].item() == len(misses)
            for j, (_, _, v) in enumerate(misses):
                assert outs[2][b, j].item() == (1 * cfg.R + r) * cfg.B + v
            assert st.lru_order[1, r].tolist() == sims[r].order()
            hits += sum(s >= cfg.W for s in slots) - len(misses)
    assert hits > 0


@pytest.mark.parametrize(
    "device,cfg,fn",
    [
        ("cpu", SMALL, swap_plan),
        ("cpu", SMALL, ref_swap_plan),  # the reference runs on the host only
        pytest.param("cuda", LARGE, swap_plan, marks=pytest.mark.gpu),
    ],
    ids=["kernel-cpu", "reference-cpu", "kernel-cuda"],
)
def test_repeats_give_the_same_bytes_every_run(device, cfg, fn):
    """20 runs on fresh identical state: identical residency, LRU order, slots and miss lists."""
    rng = random.Random(20)
    torch.manual_seed(20)
    base = random_state(cfg, device, rng)
    base.req_mode.copy_(torch.tensor([2, 2, 1, 2, 2, 0][: cfg.R] + [2] * (cfg.R - 6)))
    base.token_slot[:, ::2] = -1  # every other request starts cold: repeated misses
    base.slot_token[:, ::2] = -1
    topk, lens, req = batch(rng, cfg, 2 * cfg.R)
    first = None
    for _ in range(20):
        st = base.clone()
        outs = plan_group(fn, st, 0, topk, lens, req, 1)
        got = [o.cpu() for o in outs] + [getattr(st, n).cpu() for n in STATE]
        if first is None:
            first = got
            assert_each_position_once(st, 0, topk, lens, req, outs)
        assert all(torch.equal(a, b) for a, b in zip(first, got))
