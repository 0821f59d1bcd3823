"""The whole swap-in path end to end: append, plan, copy, then every selected slot holds the
selected token's true row (miss_copy alone against its reference: test_miss_copy.py)."""

from __future__ import annotations

import random

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.swap_plan import PlanInputs, PlanOutputs, swap_in
from kernels.store.append import kv_append
from kernels.swap.miss_copy import miss_copy
from kernels.swap.plan import swap_plan
from kv_service.memory.store import allocate_local, reset_request

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Truth:
    """The KV and index bytes every (request, layer, token) was appended with."""

    def __init__(self, layout: KVLayout, seed: int) -> None:
        self.lay, self.seed, self.kv = layout, seed, {}

    def row(self, r: int, layer: int, t: int) -> torch.Tensor:
        if (r, layer, t) not in self.kv:
            g = torch.Generator().manual_seed(hash((self.seed, r, layer, t)) % 2**31)
            self.kv[r, layer, t] = torch.randint(
                0, 256, (self.lay.row_bytes,), generator=g, dtype=torch.uint8
            )
        return self.kv[r, layer, t]


def append_tokens(kv, truth, chunks: dict[int, range], seq: dict[int, int]) -> None:
    """Append token ranges of several requests, all layers."""
    rows = [(r, t) for r, ts in chunks.items() for t in ts]
    dev = kv.device
    col = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    index = torch.zeros((len(rows), kv.layout.index_bytes), dtype=torch.uint8, device=dev)
    for layer in range(kv.layout.num_layers):
        kv_rows = torch.stack([truth.row(r, layer, t) for r, t in rows]).to(dev)
        kv_append(
            layer,
            kv_rows,
            index,
            col([r for r, _ in rows]),
            col([t for _, t in rows]),
            col([seq[r] for r, _ in rows]),
            kv.req_mode,
            kv.page_table,
            kv.host_rows,
            kv.hot_kv,
            kv.index_pool,
            window=kv.layout.window,
            row_format=kv.layout.row,
            index_format=kv.layout.index,
        )


def select(rng, prev: list[int], seq_len: int, k: int) -> list[int]:
    keep = [t for t in prev if rng.random() < 0.6]
    fresh = [t for t in rng.sample(range(seq_len), min(seq_len, 2 * k)) if t not in keep]
    sel = sorted(keep + fresh[: min(k, seq_len) - len(keep)])
    return sel + [-1] * (k - len(sel))


def swap_in_and_check(kv, truth, layer, batch, seq, rng, prev) -> set:
    """Plan + copy one layer; every selected slot must hold its token's true row."""
    lay, dev = kv.layout, kv.device
    topk = [select(rng, prev.get((layer, r), []), seq.get(r, 0), lay.topk) for r in batch]
    col = lambda xs, dt=torch.int32: torch.tensor(xs, dtype=dt, device=dev)  # noqa: E731
    bs, k = len(batch), lay.topk
    out = [
        col([[12345] * k] * bs),
        col([[12345] * k] * bs, torch.int64),
        col([[12345] * k] * bs, torch.int64),
        col([12345] * bs),
    ]
    swap_in(
        kv,
        layer,
        PlanInputs(col(topk), col([seq.get(r, 0) for r in batch]), col(batch)),
        PlanOutputs(*out),
        plan=swap_plan,
        copy=miss_copy,
    )
    slots, missed = out[0].tolist(), set()
    for b, r in enumerate(batch):
        prev[layer, r] = [t for t in topk[b] if t >= 0]
        for t, s in zip(topk[b], slots[b]):
            assert (s >= 0) == (t >= 0)
            if t >= 0:
                assert torch.equal(kv.hot_kv[layer, r, s].cpu(), truth.row(r, layer, t)), (r, t, s)
        base = (layer * lay.max_requests + r) * lay.hot_slots
        filled = {d - base for d in out[2][b, : out[3][b]].tolist()}
        missed |= {(r, t) for t, s in zip(topk[b], slots[b]) if t >= 0 and s in filled}
    return missed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row_format", ["fp8", "bf16"])
def test_end_to_end_swap_in(device, row_format):
    lay = KVLayout(
        num_layers=2,
        max_requests=4,
        hot_slots=24,
        window=3,
        topk=13,
        page_size=5,
        num_pages=48,
        max_context=80,
        row_format=row_format,
        index_format="fp8",
    )
    kv = allocate_local(lay, device)
    truth, rng = Truth(lay, seed=1), random.Random(2)
    reset_request(kv, 0, MODE_OFFLOADED, list(range(0, 16)))
    reset_request(kv, 1, MODE_RESIDENT, list(range(16, 21)))
    reset_request(kv, 3, MODE_OFFLOADED, list(range(21, 37)))
    seq = {0: 37, 1: 11, 3: 28}
    append_tokens(kv, truth, {0: range(0, 20), 3: range(0, 28), 1: range(0, 11)}, seq)
    append_tokens(kv, truth, {0: range(20, 37)}, seq)  # a second prefill chunk
    batch, prev, seen, again = [3, -1, 0, 1], {}, {}, 0
    for step in range(7):
        for r in seq:
            seq[r] += 1
        append_tokens(kv, truth, {r: [seq[r] - 1] for r in seq}, seq)
        for layer in range(lay.num_layers):
            missed = swap_in_and_check(kv, truth, layer, batch, seq, rng, prev)
            again += sum(1 for key in missed if seen.get((layer,) + key))
            seen.update({(layer,) + key: True for key in missed})
    assert again > 0, "no token was evicted and then missed again"
    assert not kv.hit_flag.any()


@pytest.mark.gpu
def test_append_plan_copy_replay_in_cuda_graph():
    """All three wrappers capture into one CUDA graph; a replay equals an eager run."""
    lay = KVLayout(
        num_layers=2,
        max_requests=4,
        hot_slots=40,
        window=4,
        topk=16,
        page_size=8,
        num_pages=32,
        max_context=128,
    )
    kv = allocate_local(lay, "cuda")
    kv.host_kv.copy_(torch.randint(0, 256, kv.host_kv.shape, dtype=torch.uint8))
    reset_request(kv, 0, MODE_OFFLOADED, list(range(16)))
    reset_request(kv, 2, MODE_OFFLOADED, list(range(16, 32)))
    dev = torch.device("cuda")
    col = lambda xs, dt=torch.int32: torch.tensor(xs, dtype=dt, device=dev)  # noqa: E731
    topk = torch.stack([torch.randperm(100)[:16], torch.randperm(90)[:16]]).int().to(dev)
    seq, pos, req = col([100, 90]), col([99, 89]), col([0, 2])
    new_kv = torch.randint(0, 256, (2, lay.row_bytes), dtype=torch.uint8, device=dev)
    new_index = torch.zeros((2, lay.index_bytes), dtype=torch.uint8, device=dev)
    out = [
        col([[0] * 16] * 2),
        col([[0] * 16] * 2, torch.int64),
        col([[0] * 16] * 2, torch.int64),
        col([0, 0]),
    ]
    state = [
        kv.host_kv,
        kv.hot_kv,
        kv.index_pool,
        kv.token_slot,
        kv.slot_token,
        kv.lru_order,
        kv.hit_flag,
        *out,
    ]
    saved = [t.clone() for t in state]

    def step():
        kv_append(
            1,
            new_kv,
            new_index,
            req,
            pos,
            seq,
            kv.req_mode,
            kv.page_table,
            kv.host_rows,
            kv.hot_kv,
            kv.index_pool,
            window=lay.window,
            row_format=lay.row,
            index_format=lay.index,
        )
        swap_in(
            kv, 1, PlanInputs(topk, seq, req), PlanOutputs(*out), plan=swap_plan, copy=miss_copy
        )

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for run in (graph.replay, step):
        torch.cuda.synchronize()  # the host tier is restored by the CPU
        for t, s in zip(state, saved):
            t.copy_(s)
        run()
        torch.cuda.synchronize()
        results.append([t.clone() for t in state])
    assert results[0][-1].sum() > 0
    for a, b in zip(*results):
        assert torch.equal(a.cpu(), b.cpu())
