"""The Triton swap plan's shared phase (kernels/swap/shared_phase.py) against the reference's
(kernels/reference/shared_swap.py), bitwise: slots, miss lists, counters, residency, and the
region's `key`, `last` and `order`, over multi-step traces on irregular sizes (several calls per
layer, speculative rows, padding, a resident request, pages freed and reused). The index's
layout may differ (its rebuild inserts in parallel), so it is checked for what it finds; the
claim scratch is empty after every call. The exact-LRU oracle runs on both plans in
tests/kernels/swap/test_swap_plan_shared.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.shared_region import INT32_MAX, SharedRegion
from kernels.reference import ref_swap_plan
from kernels.reference.shared_swap import SharedTable
from kernels.swap.plan import swap_plan
from kv_service.memory.store import allocate_local, reset_request

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
RESIDENCY = ("token_slot", "slot_token", "lru_order", "hit_flag")
REGION = ("key", "last", "order", "page_gen", "shared_len", "step")
POISON = 777


@dataclass(frozen=True)
class Case:
    lay: KVLayout
    region_buffers: int  # request slots whose buffers hold the region
    prefix: int  # tokens of the prefix the sharing requests map
    G: int  # rows per request of every call


CASES = [
    Case(KVLayout(2, 7, 20, 3, 7, 5, 90, 61, "bf16"), 2, 33, 2),
    Case(KVLayout(3, 6, 23, 1, 9, 4, 80, 45, "bf16"), 1, 21, 1),
]


class Twin:
    """One state planned by `fn` on `device`: KV tensors and a shared region."""

    def __init__(self, case: Case, fn, device: str) -> None:
        lay = case.lay
        self.fn, self.lay, self.G = fn, lay, case.G
        self.kv = allocate_local(lay, device)
        self.sh = SharedRegion.allocate(lay, case.region_buffers * lay.hot_slots, self.kv.device)

    def setup(self, pages: dict[int, list[int]], modes: dict[int, int], cached: dict[int, int]):
        for r, own in pages.items():
            reset_request(self.kv, r, modes[r], own)
            self.sh.shared_len[r] = cached[r]

    def plan(self, layer: int, rows: list[list[int]], lens: list[int], req: list[int]):
        dev, k, G = self.kv.device, self.lay.topk, self.G
        n = len(rows)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        outs = [
            torch.full((n, k), POISON, dtype=torch.int32, device=dev),
            torch.full((n // G, G * k), POISON, dtype=torch.int64, device=dev),
            torch.full((n // G, G * k), POISON, dtype=torch.int64, device=dev),
            torch.full((n // G,), POISON, dtype=torch.int32, device=dev),
        ]
        rows_out = torch.zeros((n // G,), dtype=torch.int32, device=dev)
        counts = torch.zeros((self.lay.max_requests + 1, 3), dtype=torch.int64, device=dev)
        totals = torch.zeros((2,), dtype=torch.int64, device=dev)
        kv = self.kv
        self.fn(
            layer, i32(rows), i32(lens), i32(req), kv.req_mode, kv.page_table, kv.token_slot,
            kv.slot_token, kv.lru_order, kv.hit_flag, *outs, num_layers=self.lay.num_layers,
            page_size=self.lay.page_size, window=self.lay.window, rows_per_request=G,
            out_miss_rows=rows_out, out_counts=counts, out_totals=totals, shared=self.sh,
        )  # fmt: skip
        return [x.cpu() for x in [*outs, rows_out, counts, totals]]

    def state(self) -> dict[str, torch.Tensor]:
        kv = {n: getattr(self.kv, n).cpu() for n in RESIDENCY}
        return kv | {n: getattr(self.sh, n).cpu() for n in REGION}


def assert_index_finds_every_key(sh: SharedRegion) -> None:
    """Every held slot is found by its key, the index holds nothing else."""
    for layer in range(sh.key.shape[0]):
        table = SharedTable(sh, layer)
        held = [(k, s) for s, k in enumerate(table.key) if k >= 0]
        assert all(table.lookup(k) == s for k, s in held)
        assert sorted(e for e in table.index if e >= 0) == sorted(s for _, s in held)


def assert_scratch_empty(sh: SharedRegion) -> None:
    sc = sh.scratch
    assert bool((sc.claim_key == -1).all()) and bool((sc.claim_owner == INT32_MAX).all())


def pages_of(case: Case, rng: random.Random, sharers: int):
    """Request slots outside the region: the first `sharers` map the prefix's pages and have
    it cached; the last one is resident; the rest private."""
    lay = case.lay
    slots = lay.max_requests - case.region_buffers
    prefix = list(range(-(-case.prefix // lay.page_size)))
    free = rng.sample(range(len(prefix), lay.num_pages), lay.num_pages - len(prefix))
    pages, modes, cached = {}, {}, {}
    for r in range(slots):
        own = [free.pop() for _ in range(lay.max_pages_per_request)]
        share = r < sharers
        pages[r] = (prefix + own)[: lay.max_pages_per_request] if share else own
        modes[r] = MODE_RESIDENT if r == slots - 1 else MODE_OFFLOADED
        cached[r] = case.prefix if share else 0
    return pages, modes, cached


def selection(rng: random.Random, case: Case, n: int) -> list[int]:
    """k positions biased to the prefix (repeats and bad values included)."""
    pool = list(range(min(case.prefix, n))) * 4 + list(range(n)) + [-1, n, n + 3]
    return [rng.choice(pool) for _ in range(case.lay.topk)]


def calls_of(rng: random.Random, slots: int) -> list[list[int]]:
    """Every request slot once, in random order with a padding request, cut into 1-3 calls."""
    order = rng.sample(range(slots), slots) + [-1]
    cuts = sorted(rng.sample(range(1, len(order)), rng.randint(0, 2)))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)])]


def run_pair(case: Case, device: str, seed: int, steps: int, sharers: int) -> tuple[int, int]:
    """Reference and Triton on one trace; returns the shared copies made and the missed keys
    that spilled to private slots (the Triton plan's meta: owners, owners given a slot)."""
    rng = random.Random(seed)
    ref, tri = Twin(case, ref_swap_plan, "cpu"), Twin(case, swap_plan, device)
    slots = case.lay.max_requests - case.region_buffers
    for twin in (ref, tri):
        twin.setup(*pages_of(case, random.Random(seed), sharers))
    lens = {r: case.prefix + case.lay.window + 2 + rng.randrange(4) for r in range(slots)}
    copies = spilled = 0
    for now in range(steps):
        if now == steps // 2:  # a prefix page freed and reused: its rows never hit again
            for twin in (ref, tri):
                twin.sh.forget_pages([1])
        for twin in (ref, tri):
            twin.sh.next_step()
        for layer in range(case.lay.num_layers):
            for call in calls_of(rng, slots):
                req = [r for r in call for _ in range(case.G)]
                n = [
                    lens[r] - (case.G - 1 - g) if r >= 0 else 0 for r in call for g in range(case.G)
                ]
                rows = [selection(rng, case, m) if m else [-1] * case.lay.topk for m in n]
                want, got = ref.plan(layer, rows, n, req), tri.plan(layer, rows, n, req)
                for name, a, b in zip(
                    ("slots", "src", "dst", "count", "rows", "counts", "totals"), want, got
                ):
                    assert torch.equal(a, b), (name, now, layer, call)
                for name, a in ref.state().items():
                    assert torch.equal(a, tri.state()[name]), (name, now, layer, call)
                base = (layer * case.lay.max_requests + tri.sh.base) * case.lay.hot_slots
                copies += int(((got[2] >= base) & (got[2] < base + tri.sh.slots)).sum())
                assert_scratch_empty(tri.sh)
                owners, placed = tri.sh.scratch.meta.tolist()
                spilled += owners - placed
            assert_index_finds_every_key(tri.sh)
        for r in lens:
            lens[r] += 1
    return copies, spilled


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=["G2", "G1"])
def test_triton_shared_phase_equals_the_reference(case, device):
    copies, _ = run_pair(case, device, seed=11, steps=6, sharers=3)
    assert copies > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_region_spills_alike(device):
    # Every request on the prefix, selecting more distinct rows per step than the region holds.
    case = Case(KVLayout(1, 6, 20, 3, 15, 5, 90, 61, "bf16"), 1, 40, 1)
    copies, spilled = run_pair(case, device, seed=5, steps=4, sharers=5)
    assert copies > 0 and spilled > 0
