"""swap_plan's host fallback (host_fallback=True): private buffers with fewer LRU slots than a
request's G k entries, where a missed position left without a victim reads its host row
(-2 - flat host row in out_slots, no copy, not resident). Kernel and reference bitwise over
multi-step traces (every output, counters and residency), the exact-LRU oracle with fewer
victims than misses, every entry read back by content (a host entry decodes to the host row of
its position, a slot entry's slot holds its position), and with a shared region."""

from __future__ import annotations

import random
from functools import partial
from typing import NamedTuple

import pytest
import torch
from lru_simulator import LRUSim

from contract.layout import KVLayout
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
from tests.kernels.swap.test_swap_plan_shared_triton import (
    Case,
    Twin,
    assert_scratch_empty,
    calls_of,
    pages_of,
    selection,
)
from tests.kernels.swap.test_swap_plan_union import verify_rows


def plan_outs(st: State, n: int, G: int) -> list[torch.Tensor]:
    """Poisoned outputs of every kind: slots, src, dst, count, rows, counts, totals."""
    cfg, dev = st.cfg, st.hit_flag.device
    full = lambda shape, dtype: torch.full(shape, POISON, dtype=dtype, device=dev)  # noqa: E731
    g, i32, i64 = n // G, torch.int32, torch.int64
    return [
        full((n, cfg.k), i32),
        full((g, G * cfg.k), i64),
        full((g, G * cfg.k), i64),
        full((g,), i32),
        full((g,), i32),
        torch.zeros((cfg.R + 1, 3), dtype=i64, device=dev),
        torch.zeros((2,), dtype=i64, device=dev),
    ]


def plan_both(st: State, layer, topk, lens, req, G: int, host_fallback=True) -> list:
    """Kernel and reference on copies of one state: every output and the state identical."""
    ref_st, got = st.clone(), []
    for fn, s in ((swap_plan, st), (ref_swap_plan, ref_st)):
        outs = plan_outs(s, len(topk), G)
        extra = dict(out_miss_rows=outs[4], out_counts=outs[5], out_totals=outs[6])
        plan(fn, s, layer, topk, lens, req, outs, rows_per_request=G, **extra,
             host_fallback=host_fallback)  # fmt: skip
        got.append(outs)
    assert_same_plan(st, ref_st, *got)
    return got[0]


class Residency(NamedTuple):
    """What the content check reads, from a State or a KV tensor set (on the CPU)."""

    L: int
    P: int
    W: int
    B: int
    C: int
    page_table: torch.Tensor
    token_slot: torch.Tensor
    slot_token: torch.Tensor

    @classmethod
    def of(cls, st: State) -> Residency:
        c, tensors = st.cfg, (st.page_table, st.token_slot, st.slot_token)
        return cls(c.L, c.P, c.W, c.B, c.C, *(x.cpu() for x in tensors))

    def host_row(self, layer: int, r: int, t: int) -> int:
        page = int(self.page_table[r, t // self.P])
        return (page * self.L + layer) * self.P + t % self.P


def assert_entries_read_their_rows(res: Residency, layer, r, rows, lens, slots) -> int:
    """After the plan every entry names its own row: -1 for no row (bad position, or missed
    without a mapped page), t % W in the window, an LRU slot holding t, or (<= -2) t's host row
    with t not resident. Returns the host entries."""
    W, seq_len, held = res.W, max(lens), res.slot_token[layer, r].tolist()
    resident = res.token_slot[layer, r].tolist()
    host = 0
    for row, n, got in zip(rows, lens, slots):
        for t, s in zip(row, got):
            if not 0 <= t < min(n, res.C):
                assert s == -1
            elif t >= seq_len - W:
                assert s == t % W
            elif s <= -2:
                assert -2 - s == res.host_row(layer, r, t) and resident[t] == -1
                host += 1
            elif s == -1:
                assert res.page_table[r, t // res.P] < 0 and resident[t] == -1
            elif s < res.B:  # (>= B: a shared-region row, relative to this buffer)
                assert s >= W and held[s] == t
    return host


def with_repeats(rng: random.Random, rows: list[list[int]]) -> list[list[int]]:
    """Some entries replaced by a position already in the group (in-row and cross-row), and the
    last entry by the one before it: the late misses are the ones left without a victim."""
    pool = [t for row in rows for t in row if t >= 0]
    out = [[rng.choice(pool) if pool and rng.random() < 0.15 else t for t in row] for row in rows]
    out[-1][-1] = out[-1][-2]
    return out


def full_rows(rng: random.Random, k: int, n: int, G: int) -> tuple[list[list[int]], list[int]]:
    """G rows of lengths n - G + 1 .. n, each of k distinct valid positions, about half of
    them the first row's (so the union is over k and repeats cross rows)."""
    first = rng.sample(range(n - G + 1), k)
    rows = [first] + [
        (rng.sample(first, k // 2) + rng.sample(range(n - G + 1 + j), 2 * k))[:k]
        for j in range(1, G)
    ]
    return rows, [n - G + 1 + j for j in range(G)]


CASES = [
    (Cfg(L=2, R=6, B=12, W=3, k=13, P=5, C=61), 1),
    (Cfg(L=3, R=5, B=10, W=2, k=9, P=4, C=53), 2),
    (Cfg(L=1, R=4, B=5, W=2, k=11, P=3, C=40), 2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,G", CASES, ids=["G1", "G2", "G2-tiny"])
def test_host_fallback_matches_reference_over_steps(device, cfg, G):
    assert G * cfg.k > cfg.B - cfg.W
    rng = random.Random(cfg.B * 10 + G)
    torch.manual_seed(G)
    st = random_state(cfg, device, rng)
    st.req_mode.copy_(torch.tensor([2, 1, 0] + [2] * (cfg.R - 3)))
    st.page_table[cfg.R - 1, 3:] = -1  # unmapped pages: no row, -1
    n = cfg.R + 1  # every request once, and a padding request
    req = rng.sample(range(cfg.R), cfg.R) + [-1]
    base = {r: rng.randint(cfg.k // 2, cfg.C - G) for r in req}
    host = 0
    for _ in range(3):
        for layer in rng.sample(range(cfg.L), cfg.L):
            topk, lens = [], []
            for r in req:
                rows, row_lens = verify_rows(rng, cfg.k, base[r], G, cfg.C, 0.6)
                topk, lens = topk + with_repeats(rng, rows), lens + row_lens
            outs = plan_both(st, layer, topk, lens, [r for r in req for _ in range(G)], G)
            for g, r in enumerate(req[: n - 1]):
                check_residency(st, layer, r)
                rows = slice(g * G, (g + 1) * G)
                if st.req_mode[r] == 2:
                    got = outs[0][rows].tolist()
                    res = Residency.of(st)
                    host += assert_entries_read_their_rows(
                        res, layer, r, topk[rows], lens[rows], got
                    )
        base = {r: min(b + G, cfg.C - G) for r, b in base.items()}
    assert host > 0  # some misses found no victim


@pytest.mark.parametrize("G", [1, 2])
def test_host_fallback_follows_the_lru_oracle(G):
    """The exact-LRU oracle with fewer victims than misses: the first misses take the LRU
    victims, the rest (and their repeats) name their host rows; the counters count them."""
    cfg = Cfg(L=2, R=3, B=10, W=3, k=9 if G == 1 else 6, P=5, C=90)
    rng = random.Random(G)
    torch.manual_seed(G)
    st = fresh_state(cfg, "cpu", [2, 2, 2])
    sims = {(l, r): LRUSim(cfg.B, cfg.W) for l in range(cfg.L) for r in range(cfg.R)}
    lens, host, entries = [30, 50, 70], 0, 0
    for _ in range(4):
        lens = [n + G for n in lens]
        for layer in range(cfg.L):
            groups = [full_rows(rng, cfg.k, n, G) for n in lens]
            topk = [row for rows, _ in groups for row in with_repeats(rng, rows)]
            row_lens = [n for _, ns in groups for n in ns]
            req = [r for r in range(cfg.R) for _ in range(G)]
            outs = plan_both(st, layer, topk, row_lens, req, G)
            for r in range(cfg.R):
                rows, ns = topk[r * G : (r + 1) * G], row_lens[r * G : (r + 1) * G]
                sim = sims[layer, r]
                res = Residency.of(st)
                want, misses, _, row_misses = sim.step_union(
                    rows, ns, partial(res.host_row, layer, r)
                )
                assert outs[0][r * G : (r + 1) * G].tolist() == want
                assert outs[3][r].item() == len(misses) and outs[4][r].item() == row_misses
                for j, (_, t, v) in enumerate(misses):
                    assert outs[1][r, j].item() == res.host_row(layer, r, t)
                    assert outs[2][r, j].item() == (layer * cfg.R + r) * cfg.B + v
                assert st.lru_order[layer, r].tolist() == sim.order()
                read = {t for row, s in zip(rows, want) for t, x in zip(row, s) if x <= -2}
                assert outs[5][r, 1].item() == len(misses) + len(read)
                host += len(read)
                entries += sum(x <= -2 for s in want for x in s)
            assert outs[6][1].item() == outs[5][:, 1].sum().item()
    assert entries > host > 0  # host reads, some of them repeated


def test_host_fallback_without_overflow_is_the_plain_plan():
    """Where every miss finds a victim, host_fallback changes nothing."""
    cfg = Cfg(L=2, R=5, B=30, W=3, k=13, P=5, C=61)
    rng = random.Random(3)
    torch.manual_seed(3)
    st = random_state(cfg, "cpu", rng)
    plain = st.clone()
    req = [3, 0, -1, 4]
    lens = [rng.randint(1, cfg.C) for _ in req]
    topk = [random_row(rng, cfg.k, n, cfg.C) for n in lens]
    for layer in (1, 0):
        a = plan_both(st, layer, topk, lens, req, 1)
        b = plan_both(plain, layer, topk, lens, req, 1, host_fallback=False)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert not (a[0] <= -2).any()


@pytest.mark.parametrize("host_fallback", [False, True])
def test_rejects_what_the_fallback_does_not_cover(host_fallback):
    """Without the fallback G k must fit B - W; with it W < B (an LRU slot) still must."""
    cfg = Cfg(L=1, R=2, B=12, W=3, k=10, P=5, C=40)
    st = fresh_state(cfg, "cpu", [2, 2])
    topk, fb = [[-1] * cfg.k] * 2, {"host_fallback": host_fallback}
    if host_fallback:
        plan(swap_plan, st, 0, topk, [1, 1], [0, 1], **fb)  # 10 > 9: fine with the fallback
        with pytest.raises(ValueError):
            plan(swap_plan, fresh_state(Cfg(L=1, R=2, B=3, W=3, k=10), "cpu", [2, 2]), 0, topk,
                 [1, 1], [0, 1], **fb)  # fmt: skip
    else:
        with pytest.raises(ValueError):
            plan(swap_plan, st, 0, topk, [1, 1], [0, 1], **fb)


# B - W = 9 LRU slots against G k = 14 entries per request, and a shared region of 24 slots.
SHARED_CASE = Case(KVLayout(2, 7, 12, 3, 7, 5, 90, 61, "bf16"), 2, 33, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_host_fallback_with_a_shared_region(device):
    """SHARED + HOST_FALLBACK: the region serves its rows first, the private plan falls back to
    host rows past its victims; reference and Triton bitwise, every entry reads its row."""
    case, rng, seed = SHARED_CASE, random.Random(9), 9
    ref = Twin(case, partial(ref_swap_plan, host_fallback=True), "cpu")
    tri = Twin(case, partial(swap_plan, host_fallback=True), device)
    for twin in (ref, tri):
        twin.setup(*pages_of(case, random.Random(seed), 2))
    slots = case.lay.max_requests - case.region_buffers
    lens = {r: case.prefix + case.lay.window + 2 + rng.randrange(4) for r in range(slots)}
    host = 0
    for _ in range(3):
        for twin in (ref, tri):
            twin.sh.next_step()
        for layer in range(case.lay.num_layers):
            # At most 4 requests a call: the region's scratch holds R (B - W) = 63 entries.
            for call in (c[i : i + 4] for c in calls_of(rng, slots) for i in range(0, len(c), 4)):
                req = [r for r in call for _ in range(case.G)]
                n = [
                    lens[r] - (case.G - 1 - g) if r >= 0 else 0 for r in call for g in range(case.G)
                ]
                rows = [selection(rng, case, m) if m else [-1] * case.lay.topk for m in n]
                want, got = ref.plan(layer, rows, n, req), tri.plan(layer, rows, n, req)
                assert all(torch.equal(a, b) for a, b in zip(want, got))
                for name, a in ref.state().items():
                    assert torch.equal(a, tri.state()[name]), name
                assert_scratch_empty(tri.sh)
                host += assert_twin_reads(ref, layer, rows, n, req, want[0].tolist())
        lens = {r: m + 1 for r, m in lens.items()}
    assert host > 0


def assert_twin_reads(twin: Twin, layer, rows, lens, req, slots) -> int:
    """assert_entries_read_their_rows on a Twin's KV tensors, per request of the call."""
    kv, lay, G, host = twin.kv, twin.lay, twin.G, 0
    dims = (lay.num_layers, lay.page_size, lay.window, lay.hot_slots, lay.max_context)
    res = Residency(*dims, *(x.cpu() for x in (kv.page_table, kv.token_slot, kv.slot_token)))
    for g in range(0, len(rows), G):
        r, part = req[g], slice(g, g + G)
        if r >= 0 and int(kv.req_mode[r]) == 2:
            host += assert_entries_read_their_rows(
                res, layer, r, rows[part], lens[part], slots[part]
            )
    return host
