"""swap_plan on bad input: positions out of range, padding rows, free slots, unmapped pages
and repeated positions touch nothing outside their rows; the wrapper refuses bad shapes."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.swap.plan import swap_plan
from tests.kernels.swap.test_swap_plan import (
    DEVICES,
    POISON,
    STATE,
    Cfg,
    fresh_state,
    plan,
    plan_both,
    random_state,
)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_touches_nothing(device):
    cfg = Cfg(R=6)
    rng = random.Random(7)
    torch.manual_seed(7)
    st = random_state(cfg, device, rng)
    st.req_mode.copy_(torch.tensor([2, 1, 0, 2, 2, 2]))
    st.page_table[5, 2:] = -1  # pages 2.. of request 5 unmapped and nothing of it resident
    st.token_slot[:, 5] = -1
    st.slot_token[:, 5] = -1
    before = st.clone()
    huge = [-1, -5, 40, 41, cfg.C, cfg.C + 100, 2**31 - 1, -(2**31), 39, 40, 60, -1, 2**30]
    req_slots = [-1, cfg.R, 2**31 - 1, 2, 0, 1, 3, 4, 5]
    seq_lens = [40, 40, 40, 40, 40, 2**31 - 1, -3, 0, 60]
    # Row 5 (resident, seq clamped to C): only t < B selects. Row 8: t >= 10 has no page.
    topk = (
        [list(range(13))] * 4
        + [huge, [0, 23, 24, 60, 61] + [-1] * 8]
        + [list(range(13))] * 2
        + [list(range(10, 23))]
    )
    outs = plan_both(st, 1, topk, seq_lens, req_slots)
    expect = (
        [[-1] * 13] * 4
        + [[-1] * 8 + [39 % 3] + [-1] * 4, [0, 23] + [-1] * 11]
        + [[-1] * 13] * 2
        + [[-1] * 13]
    )
    assert outs[0].tolist() == expect
    assert outs[3].tolist() == [0] * 9
    assert (outs[1] == POISON).all() and (outs[2] == POISON).all()
    for name in STATE:
        assert torch.equal(getattr(st, name), getattr(before, name)), name


@pytest.mark.parametrize("device", DEVICES)
def test_duplicate_positions_stay_in_bounds(device):
    cfg = Cfg(R=4)
    rng = random.Random(3)
    torch.manual_seed(3)
    st = random_state(cfg, device, rng)
    st.req_mode.copy_(torch.tensor([2, 2, 1, 2]))
    for step in range(4):
        topk = [[rng.randint(0, 20) for _ in range(cfg.k)] for _ in range(4)]
        outs = plan(swap_plan, st, step % cfg.L, topk, [40, 25, 21, 60], [0, 1, 2, 3])
        st.assert_guards()
        assert not st.hit_flag.any()
        assert ((outs[0] >= -1) & (outs[0] < cfg.B)).all()
        for b, r in enumerate([0, 1, 2, 3]):
            count = outs[3][b].item()
            assert 0 <= count <= cfg.k
            base = (step % cfg.L * cfg.R + r) * cfg.B
            dst = outs[2][b, :count]
            assert ((dst >= base + cfg.W) & (dst < base + cfg.B)).all()
            assert sorted(st.lru_order[step % cfg.L, r].tolist()) == list(range(cfg.W, cfg.B))


def test_wrapper_rejects_bad_shapes():
    cfg = Cfg(R=3)
    st = fresh_state(cfg, "cpu", [2, 2, 2])
    topk = [[0] * cfg.k]
    with pytest.raises(ValueError):
        plan(swap_plan, st, cfg.L, topk, [5], [0])
    st.token_slot = st.token_slot.to(torch.int64)
    with pytest.raises(ValueError):
        plan(swap_plan, st, 0, topk, [5], [0])
    with pytest.raises(ValueError):
        plan(swap_plan, fresh_state(Cfg(R=3, B=15), "cpu", [2, 2, 2]), 0, topk, [5], [0])
