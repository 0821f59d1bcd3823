"""swap_plan: exact equality with its reference, and agreement with the exact-LRU simulator over
multi-step traces. Bad input that must touch nothing:
tests/kernels/swap/test_swap_plan_bad_input.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from lru_simulator import LRUSim, check_bijection

from kernels.reference import ref_swap_plan
from kernels.swap.plan import swap_plan

POISON = 12345
GUARD = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
STATE = ("req_mode", "page_table", "token_slot", "slot_token", "lru_order", "hit_flag")
# Guard sentinels: a valid slot number in token_slot (a stray read would turn a skip into a hit),
# values the kernel never writes elsewhere.
SENTINEL = {
    "token_slot": 5,
    "slot_token": -7,
    "lru_order": -7,
    "hit_flag": 7,
    "req_mode": 2,
    "page_table": 3,
}


@dataclass(frozen=True)
class Cfg:
    L: int = 2
    R: int = 19
    B: int = 24
    W: int = 3
    k: int = 13
    P: int = 5
    C: int = 61


class State:
    """Plan state tensors, each inside a buffer whose guard bands hold a sentinel."""

    def __init__(self, cfg: Cfg, device, values: dict[str, torch.Tensor]) -> None:
        self.cfg, self.bufs = cfg, {}
        for name, v in values.items():
            buf = torch.full((2 * GUARD + v.numel(),), SENTINEL[name], dtype=v.dtype, device=device)
            buf[GUARD : GUARD + v.numel()] = v.flatten().to(device)
            self.bufs[name] = buf
            setattr(self, name, buf[GUARD : GUARD + v.numel()].view(v.shape))

    def clone(self) -> "State":
        return State(self.cfg, self.hit_flag.device, {n: getattr(self, n).clone() for n in STATE})

    def assert_guards(self) -> None:
        for name, buf in self.bufs.items():
            sentinel = SENTINEL[name]
            assert (buf[:GUARD] == sentinel).all() and (buf[-GUARD:] == sentinel).all(), name


def fresh_state(cfg: Cfg, device, modes: list[int]) -> State:
    """Empty residency (as after admission), every request's pages mapped."""
    L, R, B, W, C, P = cfg.L, cfg.R, cfg.B, cfg.W, cfg.C, cfg.P
    pages = -(-C // P)
    return State(
        cfg,
        device,
        {
            "req_mode": torch.tensor(modes, dtype=torch.int32),
            "page_table": torch.randperm(R * pages).int().view(R, pages),
            "token_slot": torch.full((L, R, C), -1, dtype=torch.int32),
            "slot_token": torch.full((L, R, B), -1, dtype=torch.int32),
            "lru_order": torch.arange(W, B, dtype=torch.int32).repeat(L, R, 1),
            "hit_flag": torch.zeros((R, B), dtype=torch.int8),
        },
    )


def random_state(cfg: Cfg, device, rng: random.Random) -> State:
    """Random modes and a random consistent residency in every (layer, request)."""
    st = fresh_state(cfg, device, [rng.choice([0, 1, 2, 2]) for _ in range(cfg.R)])
    ts, sl, order = st.token_slot.cpu(), st.slot_token.cpu(), st.lru_order.cpu()
    for l in range(cfg.L):
        for r in range(cfg.R):
            slots = list(range(cfg.W, cfg.B))
            rng.shuffle(slots)
            order[l, r] = torch.tensor(slots)
            for s, t in zip(slots[: rng.randint(0, len(slots))], rng.sample(range(cfg.C), cfg.C)):
                ts[l, r, t], sl[l, r, s] = s, t
    for name, v in (("token_slot", ts), ("slot_token", sl), ("lru_order", order)):
        getattr(st, name).copy_(v)
    return st


def outputs(bs: int, k: int, device) -> list[torch.Tensor]:
    return [
        torch.full((bs, k), POISON, dtype=torch.int32, device=device),
        torch.full((bs, k), POISON, dtype=torch.int64, device=device),
        torch.full((bs, k), POISON, dtype=torch.int64, device=device),
        torch.full((bs,), POISON, dtype=torch.int32, device=device),
    ]


def plan(
    fn, st: State, layer: int, topk, seq_lens, req_slots, outs=None, **extra
) -> list[torch.Tensor]:
    """fn's plan of one batch; `outs` (default: poisoned [bs, k] outputs) and `extra` keyword
    arguments go to fn as they are."""
    dev = st.hit_flag.device
    outs = outputs(len(topk), st.cfg.k, dev) if outs is None else outs
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    fn(
        layer,
        as_t(topk),
        as_t(seq_lens),
        as_t(req_slots),
        *(getattr(st, n) for n in STATE),
        *outs[:4],
        num_layers=st.cfg.L,
        page_size=st.cfg.P,
        window=st.cfg.W,
        **extra,
    )
    return outs


def plan_both(st: State, layer: int, topk, seq_lens, req_slots) -> list[torch.Tensor]:
    """Run kernel and reference on copies of one state; assert identical results."""
    ref_st = st.clone()
    outs = plan(swap_plan, st, layer, topk, seq_lens, req_slots)
    ref_outs = plan(ref_swap_plan, ref_st, layer, topk, seq_lens, req_slots)
    assert_same_plan(st, ref_st, outs, ref_outs)
    return outs


def assert_same_plan(st: State, ref_st: State, outs: list, ref_outs: list) -> None:
    """Kernel and reference gave the same outputs and state; the kernel's scratch is clean."""
    for got, want in zip(outs, ref_outs):
        assert torch.equal(got, want)
    for name in STATE:
        assert torch.equal(getattr(st, name), getattr(ref_st, name)), name
    assert not st.hit_flag.any()
    st.assert_guards()


def check_residency(st: State, layer: int, r: int) -> None:
    check_bijection(
        st.slot_token[layer, r].tolist(),
        st.token_slot[layer, r].tolist(),
        st.lru_order[layer, r].tolist(),
        st.cfg.W,
    )


def random_row(rng: random.Random, k: int, seq_len: int, C: int) -> list[int]:
    """Distinct valid positions mixed with padding and bad values, in random order."""
    valid = rng.sample(range(seq_len), rng.randint(0, min(k, seq_len))) if seq_len > 0 else []
    bad = [-1, -1, -3, seq_len, seq_len + 2, C, 2**31 - 1, -(2**31)]
    row = valid + [rng.choice(bad) for _ in range(k - len(valid))]
    rng.shuffle(row)
    return row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [1, 3, 17])
@pytest.mark.parametrize(
    "cfg",
    [
        Cfg(),
        Cfg(L=3, R=17, B=21, W=1, k=7, P=4, C=37),
        Cfg(L=1, R=3, B=600, W=64, k=257, P=64, C=3001),
    ],
)
def test_plan_matches_reference(device, bs, cfg):
    rng = random.Random(bs * 1000 + cfg.k)
    torch.manual_seed(bs)
    st = random_state(cfg, device, rng)
    slots = rng.sample(range(cfg.R), min(bs, cfg.R))
    req_slots = [slots[b] if b < len(slots) and rng.random() < 0.85 else -1 for b in range(bs)]
    # Both k < seq_len and k > seq_len, and seq_len beyond max_context (clamped).
    seq_lens = [
        rng.choice([rng.randint(0, cfg.k), rng.randint(cfg.k, cfg.C + 4)]) for _ in range(bs)
    ]
    topk = [random_row(rng, cfg.k, min(s, cfg.C), cfg.C) for s in seq_lens]
    for layer in (cfg.L - 1, 0):
        outs = plan_both(st, layer, topk, seq_lens, req_slots)
        count = outs[3].tolist()
        assert all(c == 0 for c, r in zip(count, req_slots) if r < 0)
        for r in range(cfg.R):
            check_residency(st, layer, r)


def next_selection(rng, prev: list[int], seq_len: int, k: int, overlap: float) -> list[int]:
    """k positions (fewer, padded with -1, when seq_len < k) keeping `overlap` of `prev`."""
    keep = rng.sample(prev, int(overlap * len(prev)))
    fresh = [t for t in rng.sample(range(seq_len), min(seq_len, 3 * k)) if t not in keep]
    sel = keep + fresh[: min(k, seq_len) - len(keep)]
    if rng.random() < 0.5:
        sel.sort()
    else:
        rng.shuffle(sel)
    return sel + [-1] * (k - len(sel))


def check_against_sim(st: State, layer, r, row, seq_len, b, outs, sim: LRUSim) -> list[int]:
    cfg = st.cfg
    slots, misses, evicted = sim.step(row, seq_len)
    assert outs[0][b].tolist() == slots
    assert outs[3][b].item() == len(misses)
    pages = st.page_table[r].tolist()
    for j, (_, t, v) in enumerate(misses):
        assert outs[1][b, j].item() == (pages[t // cfg.P] * cfg.L + layer) * cfg.P + t % cfg.P
        assert outs[2][b, j].item() == (layer * cfg.R + r) * cfg.B + v
    assert st.lru_order[layer, r].tolist() == sim.order()
    assert st.token_slot[layer, r].tolist() == [sim.where.get(t, -1) for t in range(cfg.C)]
    assert st.slot_token[layer, r].tolist() == [sim.holds.get(s, -1) for s in range(cfg.B)]
    return evicted


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.9])
def test_plan_follows_lru_simulator(device, overlap):
    cfg = Cfg(L=2, R=5, B=24, W=3, k=13, P=5, C=70)
    rng = random.Random(int(overlap * 10))
    torch.manual_seed(1)
    st = fresh_state(cfg, device, [2, 0, 2, 1, 2])
    req_slots = [4, -1, 0, 2]
    seq_lens = [30, 0, 9, 45]
    sims = {(l, r): LRUSim(cfg.B, cfg.W) for l in range(cfg.L) for r in req_slots if r >= 0}
    prev = {key: [] for key in sims}
    evicted = hits = 0
    for _ in range(8):
        seq_lens = [s + rng.randint(1, 3) if s else 0 for s in seq_lens]
        for layer in range(cfg.L):
            rows = [
                next_selection(rng, prev.get((layer, r), []), s, cfg.k, overlap)
                for r, s in zip(req_slots, seq_lens)
            ]
            outs = plan_both(st, layer, rows, seq_lens, req_slots)
            for b, (r, row, s) in enumerate(zip(req_slots, rows, seq_lens)):
                if r < 0:
                    continue
                prev[layer, r] = [t for t in row if t >= 0]
                check_residency(st, layer, r)
                evicted += len(check_against_sim(st, layer, r, row, s, b, outs, sims[layer, r]))
                hits += (
                    sum(
                        1 for t, v in zip(row, outs[0][b].tolist()) if 0 <= t < s - cfg.W and v >= 0
                    )
                    - outs[3][b].item()
                )
    assert evicted > 0 and (hits > 0 or overlap == 0.0)
