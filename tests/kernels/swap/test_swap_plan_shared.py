"""The swap plan's shared region (issue 40, item 1), the reference's and the Triton plan's: rows of
cached prefix pages live once per layer whichever requests select them. Checked against the
exact-LRU oracle (tests/lru_simulator.py: one LRU over the shared region, one per request over
its private slots) over multi-step traces of several requests split into two plan calls per
layer (as the micro-batches do), and by content: after every call of a step, every entry of
every call reads its own row, so no call evicted a slot another request reads this step."""

from __future__ import annotations

import random

import pytest
import torch
from lru_simulator import LRUSim, SharedLRUSim

from contract.layout import MODE_OFFLOADED, KVLayout
from contract.shared_region import SharedRegion
from kernels.reference import ref_miss_copy, ref_swap_plan
from kernels.reference.shared_swap import row_key
from kernels.swap.miss_copy import miss_copy
from kernels.swap.plan import swap_plan
from kv_service.memory.store import allocate_local, reset_request

LAY = KVLayout(
    num_layers=2,
    max_requests=5,
    hot_slots=16,
    window=2,
    topk=8,
    page_size=4,
    num_pages=64,
    max_context=64,
    row_format="bf16",
)
PREFIX = 24  # tokens of the shared prefix: pages 0..5
PLANS = pytest.mark.parametrize("plan", [ref_swap_plan, swap_plan], ids=["ref", "triton"])


class Harness:
    """Four offloaded requests on slots 0..3, the region in slot 4's buffers, host rows of
    random bytes; the oracle beside it."""

    def __init__(self, seed: int, sharing: int = 3, plan=ref_swap_plan, device="cpu") -> None:
        torch.manual_seed(seed)
        self.plan_fn, self.dev = plan, torch.device(device)
        # Request slots [0, sharing) share the prefix; the others share nothing.
        self.shared_len = [PREFIX if r < sharing else 0 for r in range(4)]
        self.spilled = 0
        self.kv = allocate_local(LAY, self.dev)
        self.sh = SharedRegion.allocate(LAY, LAY.hot_slots, self.dev)
        self.kv.host_kv.copy_(torch.randint(0, 256, self.kv.host_kv.shape, dtype=torch.uint8))
        prefix = list(range(PREFIX // LAY.page_size))
        for r in range(4):
            own = [10 + 12 * r + i for i in range(LAY.max_pages_per_request)]
            pages = (prefix + own)[: LAY.max_pages_per_request] if self.shared_len[r] else own
            reset_request(self.kv, r, MODE_OFFLOADED, pages)
            self.sh.shared_len[r] = self.shared_len[r]
        self.shared = [SharedLRUSim(self.sh.slots) for _ in range(LAY.num_layers)]
        self.private = [[LRUSim(LAY.hot_slots, LAY.window) for _ in range(4)] for _ in range(2)]

    def host_row(self, r: int, layer: int, t: int) -> torch.Tensor:
        page = int(self.kv.page_table[r, t // LAY.page_size])
        return self.kv.host_kv[page, layer, t % LAY.page_size]

    def row_id(self, r: int, t: int) -> int:
        page = int(self.kv.page_table[r, t // LAY.page_size])
        gen = int(self.sh.page_gen[page])
        return row_key(gen, page * LAY.page_size + t % LAY.page_size)

    def plan(self, layer: int, rows: list[list[int]], lens: list[int], req: list[int]):
        """The plan + copy of one call; returns (slots, miss count, copies)."""
        n, k = len(rows), LAY.topk
        dev, i64 = self.dev, torch.int64
        slots = torch.full((n, k), -7, dtype=torch.int32, device=dev)
        src, dst = torch.zeros((n, k), dtype=i64, device=dev), torch.zeros_like(slots, dtype=i64)
        count = torch.zeros((n,), dtype=torch.int32, device=dev)
        kv = self.kv
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        self.plan_fn(
            layer, i32(rows), i32(lens), i32(req), kv.req_mode, kv.page_table, kv.token_slot,
            kv.slot_token, kv.lru_order, kv.hit_flag, slots, src, dst, count,
            num_layers=LAY.num_layers, page_size=LAY.page_size, window=LAY.window,
            shared=self.sh,
        )  # fmt: skip
        copy = miss_copy if dev.type == "cuda" else ref_miss_copy
        copy(kv.host_rows, kv.hot_kv, src, dst, count)
        copies = {(int(s), int(d)) for b in range(n) for s, d in zip(src[b, : count[b]], dst[b])}
        return slots.tolist(), count.tolist(), copies

    def oracle(self, layer: int, rows: list[list[int]], lens: list[int], req: list[int], now):
        """The oracle's slot lists (relative to each request's buffer) and copies."""
        W, B, base = LAY.window, LAY.hot_slots, self.sh.base
        flat = []
        for row, n, r in zip(rows, lens, req):
            priv = self.private[layer][r] if r >= 0 else None
            for t in row:
                ok = r >= 0 and 0 <= t < min(n - W, self.shared_len[r]) and t not in priv.where
                flat.append(self.row_id(r, t) if ok else None)
        sh_slots, sh_copies, spilled = self.shared[layer].step(flat, now)
        self.spilled += len(spilled)
        out, copies, k = [], set(), LAY.topk
        for b, (row, n, r) in enumerate(zip(rows, lens, req)):
            mine = sh_slots[b * k : (b + 1) * k]
            if r < 0:
                out.append([-1] * k)
                continue
            private = [-1 if s >= 0 else t for t, s in zip(row, mine)]
            p_slots, p_miss, _ = self.private[layer][r].step(private, n)
            out.append([(base - r) * B + s if s >= 0 else p for s, p in zip(mine, p_slots)])
            for _, t, v in p_miss:
                copies.add((self.src(r, layer, t), (layer * LAY.max_requests + r) * B + v))
        for i, _, v in sh_copies:
            b, r = i // k, req[i // k]
            t = rows[b][i % k]
            copies.add((self.src(r, layer, t), (layer * LAY.max_requests + base) * B + v))
        return out, copies

    def src(self, r: int, layer: int, t: int) -> int:
        page = int(self.kv.page_table[r, t // LAY.page_size])
        return (page * LAY.num_layers + layer) * LAY.page_size + t % LAY.page_size

    def assert_reads(self, layer, rows, lens, req, slots) -> None:
        """Every valid entry's slot holds its own row (hot row = host row); the window ring
        is kv_append's (not run here)."""
        hot = self.kv.hot_kv.view(LAY.num_layers, -1, LAY.row_bytes)[layer].cpu()
        for row, n, r, got in zip(rows, lens, req, slots):
            for t, s in zip(row, got):
                if r >= 0 and 0 <= t < n - LAY.window:
                    assert torch.equal(hot[r * LAY.hot_slots + s], self.host_row(r, layer, t))


def selection(rng: random.Random, n: int) -> list[int]:
    """k positions, mostly in the shared prefix (so the region fills and spills), a few bad."""
    pool = list(range(PREFIX)) * 3 + list(range(n))
    row = list(dict.fromkeys(rng.sample(pool, 3 * LAY.topk)))[: LAY.topk - 1]
    return row + [rng.choice([-1, n, n + 5])]


def run_trace(seed, steps, refresh_at=None, sharing=3, plan=ref_swap_plan, device="cpu"):
    """Steps of 4 requests (and a padding row) in two plan calls per layer; returns (shared
    copies made, entries that spilled to private slots)."""
    rng, h = random.Random(seed), Harness(seed, sharing, plan, device)
    lens = {r: 40 + r for r in range(4)}
    shared_copies = 0
    for now in range(1, steps + 1):
        if now == refresh_at:  # a prefix page freed and reused with other rows
            h.sh.forget_pages([3])
            h.kv.host_kv[3] = torch.randint(0, 256, h.kv.host_kv[3].shape, dtype=torch.uint8)
        h.sh.next_step()
        order = rng.sample(range(4), 4) + [-1]
        calls = [order[:2], order[2:]]
        for layer in range(LAY.num_layers):
            done = []
            for call in calls:
                req = list(call)
                n = [lens[r] if r >= 0 else 0 for r in req]
                rows = [selection(rng, m) if m else [-1] * LAY.topk for m in n]
                want, want_copies = h.oracle(layer, rows, n, req, now)
                slots, _, copies = h.plan(layer, rows, n, req)
                assert slots == want
                assert copies == want_copies
                base_row = (layer * LAY.max_requests + h.sh.base) * LAY.hot_slots
                shared_copies += sum(base_row <= d < base_row + h.sh.slots for _, d in copies)
                done.append((rows, n, req, slots))
            for rows, n, req, slots in done:
                h.assert_reads(layer, rows, n, req, slots)
        for r in lens:
            lens[r] += 1
    return shared_copies, h.spilled


@PLANS
def test_shared_region_matches_oracle_and_reads_its_rows(plan):
    copies, _ = run_trace(seed=1, steps=12, plan=plan)
    assert copies > 0


@pytest.mark.gpu
def test_triton_on_cuda_matches_oracle_and_spills():
    copies, _ = run_trace(seed=1, steps=12, plan=swap_plan, device="cuda")
    _, spilled = run_trace(seed=4, steps=8, sharing=4, plan=swap_plan, device="cuda")
    assert copies > 0 and spilled > 0


@PLANS
def test_full_region_spills_to_private_slots(plan):
    # Four requests' selections exceed the region's 16 slots within a step: the rest spill.
    _, spilled = run_trace(seed=4, steps=8, sharing=4, plan=plan)
    assert spilled > 0


@PLANS
def test_freed_page_rows_never_hit_again(plan):
    run_trace(seed=2, steps=10, refresh_at=5, plan=plan)


@PLANS
def test_one_copy_per_row_whichever_requests_select_it(plan):
    h = Harness(3, plan=plan)
    h.sh.next_step()
    row = [1, 5, 9, 13, 17, 21, -1, -1]
    slots, count, copies = h.plan(0, [row, row, row], [40, 41, 42], [0, 1, 2])
    assert count == [6, 0, 0] and len(copies) == 6
    B = LAY.hot_slots  # the same absolute hot rows, each written relative to its own buffer
    rows = [[r * B + s if s >= 0 else -1 for s in got] for r, got in enumerate(slots)]
    assert rows[0] == rows[1] == rows[2]
    assert all(h.sh.base * B <= x < (h.sh.base + 1) * B for x in rows[0] if x >= 0)
    assert h.sh.live(LAY.page_size) == 6
    h.sh.forget_pages(list(range(6)))
    assert h.sh.live(LAY.page_size) == 0


def test_the_table_agrees_with_a_dict_over_random_inserts_and_removals():
    """Linear probing with back-shift deletion: after any mix of operations every held key is
    found at its slot and no removed key is (the region's lookups rely on it)."""
    from kernels.reference.shared_swap import SharedTable

    rng = random.Random(5)
    sh = SharedRegion.allocate(LAY, LAY.hot_slots, torch.device("cpu"))
    table, held = SharedTable(sh, 0), {}
    for _ in range(2000):
        free = [s for s in range(sh.slots) if s not in held.values()]
        if free and (not held or rng.random() < 0.55):
            key = rng.choice([rng.randrange(1 << 40), rng.randrange(64)])
            if key not in held:
                held[key] = rng.choice(free)
                table.insert(held[key], key)
        elif held:
            key = rng.choice(sorted(held))
            table.remove(held.pop(key))
            assert table.lookup(key) == -1
        assert all(table.lookup(k) == s for k, s in held.items())
