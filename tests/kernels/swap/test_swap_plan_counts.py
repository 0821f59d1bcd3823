"""The select bookkeeping the plan adds (out_counts per request slot, out_totals): the same sums
as the backends' own counting (engine_client.kv.backend.SlotCounts.add over the plan's miss
lists), in the kernel and its reference, added to what the counters held."""

from __future__ import annotations

import random

import pytest
import torch

from engine_client.kv.backend import SlotCounts
from kernels.reference import ref_swap_plan
from kernels.swap.plan import swap_plan
from tests.kernels.swap.test_swap_plan import (
    DEVICES,
    Cfg,
    assert_same_plan,
    random_row,
    random_state,
)
from tests.kernels.swap.test_swap_plan_union import plan_group


def counted(fn, st, layer, topk, lens, req, G, held):
    """fn's plan with counters that start at `held`; returns (outputs, counts, totals)."""
    counts, totals = held[0].clone(), held[1].clone()
    outs = plan_group(fn, st, layer, topk, lens, req, G, out_counts=counts, out_totals=totals)
    return outs, counts, totals


def expected(held, topk, req, outs, G):
    """What select counted before the plan did: SlotCounts.add and two sums."""
    dev = held[0].device
    want = SlotCounts(held[0].shape[0] - 1, dev)
    want.table.copy_(held[0])
    t, r = (torch.tensor(x, dtype=torch.int32, device=dev) for x in (topk, req))
    want.add(r, t, outs[3], outs[4], G)
    totals = held[1] + torch.stack([(t >= 0).sum(), outs[3].long().sum()])
    return want.table, totals


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("G", [1, 3])
def test_plan_counts_what_select_counted(device, G):
    cfg = Cfg(L=2, R=7, B=33, W=3, k=7, P=5, C=61)
    rng = random.Random(G)
    torch.manual_seed(G)
    st = random_state(cfg, device, rng)  # offloaded, resident and free slots
    # Half the slots start with nothing resident, so there are misses to count.
    st.token_slot[:, ::2] = -1
    st.slot_token[:, ::2] = -1
    req = [r for r in (0, -1, 2, 3, -1, 6) for _ in range(G)]
    # A row marked padding inside a request's group: its entries count at row R, as select's
    # per-row count put them (the plan itself reads the group's first row's slot).
    req[-1] = -1 if G > 1 else req[-1]
    held = (
        torch.randint(0, 50, (cfg.R + 1, 3), dtype=torch.int64, device=device),
        torch.randint(0, 50, (2,), dtype=torch.int64, device=device),
    )
    misses = 0
    for layer in (1, 0):
        lens = [rng.randint(0, cfg.C + 3) for _ in req]
        topk = [random_row(rng, cfg.k, min(n, cfg.C), cfg.C) for n in lens]
        topk[G] = [5, -1, 9, -7, 0, 2**31 - 1, 3]  # a padding row's entries count at row R
        ref_st = st.clone()
        got = counted(swap_plan, st, layer, topk, lens, req, G, held)
        ref = counted(ref_swap_plan, ref_st, layer, topk, lens, req, G, held)
        assert_same_plan(st, ref_st, got[0], ref[0])
        want = expected(held, topk, req, got[0], G)
        for counts, totals in (got[1:], ref[1:]):
            assert torch.equal(counts, want[0]) and torch.equal(totals, want[1])
        misses += int(got[0][3].sum())
        held = got[1:]
    assert misses > 0
