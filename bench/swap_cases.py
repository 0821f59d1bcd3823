"""Swap-in cases of bench/kernels.py: the plan kernel, and plan + copy of a decode step
against a contiguous pinned copy of the same bytes measured in the same run (the anchor of
issue 23: at bs 1, 16, 64, 128 and 256)."""

from __future__ import annotations

import torch

from bench.kernel_cases import BS, B, C, K, P, W, _distinct
from bench.timing import Row, cpu_call_us, graph_time_us
from kernels.uva import UVATensor


class PlanState:
    """One layer of residency state for bs requests of ctx tokens."""

    def __init__(self, resident: bool = False, bs: int = BS, ctx: int = C) -> None:
        BS, C = bs, ctx  # noqa: N806
        self.bs, self.ctx = bs, ctx
        pages = C // P
        self.topk = torch.empty((BS, K), dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((BS,), C, dtype=torch.int32, device="cuda")
        self.req_slots = torch.arange(BS, dtype=torch.int32, device="cuda")
        self.req_mode = torch.full((BS,), 1 if resident else 2, dtype=torch.int32, device="cuda")
        self.page_table = torch.arange(BS * pages, dtype=torch.int32, device="cuda").view(BS, pages)
        self.token_slot = torch.full((1, BS, C), -1, dtype=torch.int32, device="cuda")
        self.slot_token = torch.full((1, BS, B), -1, dtype=torch.int32, device="cuda")
        self.lru_order = (
            torch.arange(W, B, dtype=torch.int32, device="cuda").repeat(1, BS, 1).contiguous()
        )
        self.hit_flag = torch.zeros((BS, B), dtype=torch.int8, device="cuda")
        self.out_slots = torch.empty((BS, K), dtype=torch.int32, device="cuda")
        self.miss_src = torch.empty((BS, K), dtype=torch.int64, device="cuda")
        self.miss_dst = torch.empty((BS, K), dtype=torch.int64, device="cuda")
        self.miss_count = torch.empty((BS,), dtype=torch.int32, device="cuda")
        # The select bookkeeping the engine's plan adds (per request slot and totals).
        self.counts = torch.zeros((BS + 1, 3), dtype=torch.int64, device="cuda")
        self.totals = torch.zeros((2,), dtype=torch.int64, device="cuda")

    def plan(self) -> None:
        self.plan_with()

    def plan_with(self, **knobs) -> None:
        from kernels.swap.plan import swap_plan

        swap_plan(
            0,
            self.topk,
            self.seq_lens,
            self.req_slots,
            self.req_mode,
            self.page_table,
            self.token_slot,
            self.slot_token,
            self.lru_order,
            self.hit_flag,
            self.out_slots,
            self.miss_src,
            self.miss_dst,
            self.miss_count,
            num_layers=1,
            page_size=P,
            window=W,
            out_counts=self.counts,
            out_totals=self.totals,
            **knobs,
        )

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.token_slot, self.slot_token, self.lru_order)]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip((self.token_slot, self.slot_token, self.lru_order), snap):
            t.copy_(s)


def plan_case(ceil: dict, reps: int) -> list[Row]:
    st = PlanState()
    first = _distinct(BS, K, 0, C - W).cuda()
    st.topk.copy_(first)
    st.plan()  # fills the LRU slots: every later call with the same selection is all hits
    nomiss = graph_time_us(st.plan, reps, inner=20)
    misses = int(st.miss_count.sum())
    variants = []
    for nw in (4, 16):
        v = graph_time_us(lambda: st.plan_with(num_warps=nw), reps, inner=20)
        variants.append(Row("swap_plan", f"0% miss, num_warps={nw}", v, v / 10.0, "variant"))
    rows = [
        Row(
            "swap_plan",
            "bs64 k2048 B4096, 0% miss",
            nomiss,
            nomiss / 10.0,
            f"target <=10us (ratio = us/10); misses seen {misses}; "
            f"cpu/call {cpu_call_us(st.plan):.1f}us",
        )
    ]
    res = PlanState(resident=True)
    res.seq_lens.fill_(B)
    res.topk.copy_(_distinct(BS, K, 0, B).cuda())
    us = graph_time_us(res.plan, reps, inner=20)
    rows.append(
        Row(
            "swap_plan", "resident fast path (seq_len<=B)", us, us / nomiss, "ratio vs 0% miss plan"
        )
    )
    rows.extend(variants)
    us, _, n_miss, _ = _swap(PlanState(), first, reps)
    bound = 1.15 * n_miss * 1152 / (ceil["h2d_gbs"] * 1e3) + nomiss
    rows.append(
        Row(
            "swap(plan+copy)",
            f"bs64 10% miss ({n_miss} rows)",
            us,
            us / bound,
            f"bound 1.15*bytes/copyBW+floor = {bound:.1f}us; target ratio <=1",
        )
    )
    return rows


def _next_step(first: torch.Tensor, ctx: int, frac: float) -> torch.Tensor:
    """first with its first frac of entries replaced by tokens it did not select (misses)."""
    bs, n_new = first.shape[0], int(K * frac)
    step = first.clone()
    for b in range(bs):
        pool = torch.ones(ctx - W, dtype=torch.bool)
        pool[first[b].cpu().long()] = False
        cand = pool.nonzero().view(-1)
        step[b, :n_new] = cand[torch.randperm(cand.numel())[:n_new]].to(torch.int32).cuda()
    return step


def _swap(st: PlanState, first: torch.Tensor, reps: int, d: int = 1152, frac: float = 0.1):
    """(plan + copy µs, plan alone µs, miss rows, same-run contiguous pinned copy µs of the
    same bytes) for one decode step whose selection changes by frac."""
    from kernels.swap.miss_copy import miss_copy

    st.topk.copy_(first)
    st.plan()  # fills the LRU slots with the first selection
    st.topk.copy_(_next_step(first, st.ctx, frac))
    host = torch.empty((st.bs * st.ctx, d), dtype=torch.uint8, pin_memory=True)
    host[: min(host.shape[0], 1 << 16)].random_(0, 255)
    uva = UVATensor(host)
    hot = torch.zeros((st.bs * B, d), dtype=torch.uint8, device="cuda")
    snap = st.snapshot()

    def swap() -> None:
        st.plan()
        miss_copy(uva, hot, st.miss_src, st.miss_dst, st.miss_count)

    us = graph_time_us(swap, reps, setup=lambda: st.restore(snap))
    plan_us = graph_time_us(st.plan, reps, setup=lambda: st.restore(snap))
    n = int(st.miss_count.sum())
    dev = torch.empty(max(1, n * d), dtype=torch.uint8, device="cuda")
    flat = host.view(-1)[: dev.numel()]
    pinned = graph_time_us(lambda: dev.copy_(flat, non_blocking=True), reps)
    del host
    return us, plan_us, n, pinned


def swap_anchor_case(ceil: dict, reps: int) -> list[Row]:
    """Plan + copy of one decode step (10% of each request's selection new: misses; 16K-token
    contexts, 1152 B rows) against a contiguous pinned copy of the same bytes, same run."""
    rows = []
    for bs in (1, 16, 64, 128, 256):
        ctx = 16384
        st = PlanState(bs=bs, ctx=ctx)
        us, plan_us, n, pinned = _swap(st, _distinct(bs, K, 0, ctx - W).cuda(), reps)
        rows.append(
            Row(
                "swap(plan+copy)",
                f"bs{bs} 10% ({n} rows x 1152B)",
                us,
                us / pinned,
                f"contiguous pinned copy of the same bytes {pinned:.1f}us (ratio col); plan "
                f"alone {plan_us:.1f}us; plan+copy - plan - pinned = {us - plan_us - pinned:.1f}us",
            )
        )
        del st
    return rows


ALL = [plan_case, swap_anchor_case]
