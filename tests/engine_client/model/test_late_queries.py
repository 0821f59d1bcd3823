"""Model.late_queries (bench.profile --late-queries): a layer's attention queries (q_b_proj,
W_UK, q_pe's RoPE) are launched after every micro-batch part's swap-in plan, so they run beside
the parts' miss copies instead of before the first plan. The same ops on the same inputs: the
logits, counters and KV state equal the default order's bit for bit."""

from __future__ import annotations

import pytest

from contract.layout import MODE_OFFLOADED
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet
from kv_service.memory.store import allocate_local, reset_request
from tests.engine_client.model.test_overlap import CFG, LAYOUT, assert_same, decode


def _launch_order(monkeypatch, late: bool, rows: int = 5) -> list[tuple[str, int]]:
    """What one decode step launches per layer: each part's select, the queries, each
    part's join of its copy (the attention follows the join)."""
    kv = allocate_local(LAYOUT, "cpu")
    for slot in range(rows):
        reset_request(kv, slot, MODE_OFFLOADED, list(range(slot * 7, slot * 7 + 7)))
    backend = HiSparseBackend(kv, kernels=KernelSet.reference(), microbatches=2)
    model = Model(CFG, random_weights(CFG, seed=3), backend, late_queries=late)
    events: list[tuple[str, int]] = []
    select, queries = backend.select, model._queries

    def spy_select(layer, topk, req_slots, seq_lens, row0=0, **kw):
        events.append(("select", row0))
        return select(layer, topk, req_slots, seq_lens, row0=row0, **kw)

    def spy_queries(*a):
        events.append(("queries", -1))
        return queries(*a)

    monkeypatch.setattr(backend, "select", spy_select)
    monkeypatch.setattr(backend, "attention_ready", lambda row0: events.append(("join", row0)))
    monkeypatch.setattr(model, "_queries", spy_queries)
    runner = ModelRunner(model, DecodeConfig(max_batch=rows, use_graphs=False))
    runner.step([1] * rows, [20] * rows, list(range(rows)), [21] * rows)
    return events


def test_late_queries_launch_between_the_last_plan_and_the_first_attention(monkeypatch):
    selects, joins = [("select", 0), ("select", 2)], [("join", 0), ("join", 2)]
    late = _launch_order(monkeypatch, late=True)
    assert late == (selects + [("queries", -1)] + joins) * CFG.num_layers
    default = _launch_order(monkeypatch, late=False)
    assert default == ([("queries", -1)] + selects + joins) * CFG.num_layers


@pytest.mark.slow
def test_late_queries_bitwise_on_cpu():
    kernels, weights = KernelSet.triton(), random_weights(CFG, seed=3)
    one = decode(2, "cpu", False, kernels, weights)
    assert one[3]["misses"] > 0  # the offloaded requests really swap
    assert_same(one, decode(2, "cpu", False, kernels, weights, late_queries=True))
    # The part tail on top: its parts still follow their attention.
    tail = decode(2, "cpu", False, kernels, weights, bucket=8, tail_parts=2)
    late = decode(2, "cpu", False, kernels, weights, bucket=8, tail_parts=2, late_queries=True)
    assert_same(tail, late)


@pytest.mark.gpu
def test_late_queries_graphed_bitwise_on_gpu():
    """Inside the captured graph, beside the side-stream copy, against one eager batch."""
    kernels, weights = KernelSet.triton(), random_weights(CFG, seed=3, device="cuda")
    one = decode(1, "cuda", False, kernels, weights)
    assert one[3]["misses"] > 0
    assert_same(one, decode(2, "cuda", True, kernels, weights, bucket=8, late_queries=True))
