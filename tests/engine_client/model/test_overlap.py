"""Decode micro-batches with the miss copy on a side stream (HiSparseBackend.microbatches):
bitwise the same logits, KV state and per-request counters as one batch, and the step still
captures into a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.tensors import TENSOR_NAMES
from engine_client.kv.hisparse import OVERLAP_COPY_GRID, HiSparseBackend
from engine_client.model.attention import row_parts
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import preset
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet
from kernels.swap.copy_grid import CopyGrid
from kv_service.memory.store import allocate_local, reset_request

CFG = preset("tiny", topk=8)
LAYOUT = KVLayout(
    num_layers=2,
    max_requests=8,
    hot_slots=9,
    window=1,
    topk=8,
    page_size=4,
    num_pages=60,
    max_context=48,
)
# slot -> synthetic context; slot 3 is resident (fits in B), the others offloaded.
CONTEXTS = {0: 30, 1: 21, 2: 40, 3: 4}
STEPS = 3


def testrow_parts_cover_the_rows_once():
    assert row_parts(7, 1) == [slice(0, 7)]
    assert row_parts(7, 2) == [slice(0, 3), slice(3, 7)]
    assert row_parts(2, 3) == [slice(0, 1), slice(1, 2)]
    assert row_parts(1, 4) == [slice(0, 1)]


def decode(
    microbatches: int,
    device: str,
    graphs: bool,
    kernels: KernelSet,
    weights,
    copy_grid: CopyGrid = OVERLAP_COPY_GRID,
    bucket: int = 5,
    shapes=None,
    tail_parts: int = 1,
    switch_to: CopyGrid | None = None,
    late_queries: bool = False,
):
    """switch_to: the copy's grid after the first step's graph (recaptured on it);
    tail_parts, late_queries: the Model's."""
    cfg, lay, contexts = shapes or (CFG, LAYOUT, CONTEXTS)
    kv = allocate_local(lay, device)
    per = lay.num_pages // len(contexts)
    for slot, ctx in contexts.items():
        pages = list(range(slot * per, slot * per + lay.pages_for(ctx + STEPS)))
        resident = ctx + STEPS <= lay.hot_slots
        reset_request(kv, slot, MODE_RESIDENT if resident else MODE_OFFLOADED, pages)
    backend = HiSparseBackend(kv, kernels=kernels, microbatches=microbatches, copy_grid=copy_grid)
    model = Model(cfg, weights, backend, tail_parts=tail_parts, late_queries=late_queries)
    runner = ModelRunner(
        model, DecodeConfig(max_batch=bucket, buckets=(bucket,), use_graphs=graphs)
    )
    for slot, ctx in contexts.items():
        backend.fill_synthetic(slot, ctx, seed=slot, chunk=16 if device == "cpu" else 4096)
    slots, last, out, counts = list(contexts), [1, 2, 3, 4], [], []
    for step in range(STEPS):
        pos = [contexts[s] + step for s in slots]
        logits = runner.step(last, pos, slots, [p + 1 for p in pos])
        out.append(logits.clone().cpu())
        counts.append(backend.counts.cpu().tolist())
        backend.counts.zero_()
        last = logits.argmax(dim=-1).tolist()
        if switch_to is not None and step == 0:
            backend.set_copy_grid(switch_to)
            runner.drop_graphs()
    state = {name: getattr(kv, name).clone().cpu() for name in TENSOR_NAMES}
    return out, counts, state, backend.stats()


def assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1] == b[1] and a[3] == b[3]
    for name in TENSOR_NAMES:
        assert torch.equal(a[2][name], b[2][name]), name


def test_every_part_joins_its_copy_before_attention(monkeypatch):
    """A side-stream copy that attention never waits for is work a CUDA graph capture refuses
    ("capturing stream has unjoined work"): with micro-batches on, every part of every layer,
    the single part of a batch of 1 too, waits for its own copy before its attention."""
    kernels, weights = KernelSet.reference(), random_weights(CFG, seed=3)
    for rows, expect in ((1, [0]), (2, [0, 1]), (5, [0, 2])):
        kv = allocate_local(LAYOUT, "cpu")
        for slot in range(rows):
            reset_request(kv, slot, MODE_OFFLOADED, list(range(slot * 7, slot * 7 + 7)))
        inner = HiSparseBackend(kv, kernels=kernels, microbatches=2)
        events: list[tuple[str, int]] = []
        select = inner.select

        def spy_select(
            layer, topk, req_slots, seq_lens, row0=0, select=select, events=events, **kw
        ):
            events.append(("select", row0))
            return select(layer, topk, req_slots, seq_lens, row0=row0, **kw)

        monkeypatch.setattr(inner, "select", spy_select)
        monkeypatch.setattr(
            inner, "attention_ready", lambda row0, events=events: events.append(("join", row0))
        )
        model = Model(CFG, weights, inner)
        runner = ModelRunner(model, DecodeConfig(max_batch=rows, use_graphs=False))
        slots = list(range(rows))
        runner.step([1] * rows, [20] * rows, slots, [21] * rows)
        per_layer = [("select", r) for r in expect] + [("join", r) for r in expect]
        assert events == per_layer * CFG.num_layers, (rows, events)


@pytest.mark.slow
def test_microbatches_bitwise_on_cpu():
    kernels, weights = KernelSet.triton(), random_weights(CFG, seed=3)
    one = decode(1, "cpu", False, kernels, weights)
    assert one[3]["misses"] > 0  # the offloaded requests really swap
    assert_same(one, decode(2, "cpu", False, kernels, weights))
    # Three parts of a padded bucket: the last part holds only padding rows; four: two such.
    assert_same(one, decode(3, "cpu", False, kernels, weights, bucket=8))
    assert_same(one, decode(4, "cpu", False, kernels, weights, bucket=8))


def test_part_tail_bitwise_on_cpu():
    """The part tail with micro-batches equals one attention part whose tail splits alike."""
    kernels, weights = KernelSet.reference(), random_weights(CFG, seed=3)
    for m in (2, 3):
        one = decode(1, "cpu", False, kernels, weights, bucket=8, tail_parts=m)
        assert one[3]["misses"] > 0
        assert_same(one, decode(m, "cpu", False, kernels, weights, bucket=8, tail_parts=m))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "copy_grid",
    [
        OVERLAP_COPY_GRID,
        CopyGrid(programs=4),
        CopyGrid(programs=6, bytes_per_program=1),
        CopyGrid(programs=6, bytes_per_program=1, priority=-1),
        CopyGrid(programs=8, chunk_bytes=64 << 10, warps=32, sms=8),
        # The staged copy: host nodes and copy-engine uploads inside the graph, every miss
        # staged (1 MiB a part), and a budget of a few rows with the rest read by the SMs.
        CopyGrid(programs=4, staged_bytes=1 << 20, staged_chunks=3, staged_threads=2),
        CopyGrid(programs=4, staged_bytes=4096),
    ],
    ids=lambda g: g.label(),
)
def test_microbatches_graphed_bitwise_on_gpu(copy_grid):
    """Side-stream copy inside the captured graph vs one eager batch: same bits, whatever
    the copy's grid, the rule choosing its working CTAs, the side stream's priority, whether
    the copy and the model share SMs (sms: disjoint green-context streams), and whether host
    threads and the copy engine stage the misses."""
    kernels, weights = KernelSet.triton(), random_weights(CFG, seed=3, device="cuda")
    one = decode(1, "cuda", False, kernels, weights)
    assert one[3]["misses"] > 0
    two = decode(2, "cuda", True, kernels, weights, copy_grid=copy_grid, bucket=8)
    assert_same(one, two)


@pytest.mark.gpu
def test_copy_grid_switch_moves_the_streams_on_gpu():
    """set_copy_grid (the copy sweep's switch): a grid with SMs of its own gets a green side
    stream and sends the model to the rest; back on shared SMs the model runs on the caller's
    stream again; a step captured after each switch gives the bits of one eager batch."""
    kernels, weights = KernelSet.triton(), random_weights(CFG, seed=3, device="cuda")
    kv = allocate_local(LAYOUT, "cuda")
    backend = HiSparseBackend(kv, kernels=kernels, microbatches=2)
    assert backend.compute_stream is None
    green = CopyGrid(programs=8, sms=8)
    backend.set_copy_grid(green)
    assert backend.copy_grid == green and backend.compute_stream is not None
    backend.set_copy_grid(OVERLAP_COPY_GRID)
    assert backend.copy_grid == OVERLAP_COPY_GRID and backend.compute_stream is None
    one = decode(1, "cuda", False, kernels, weights)
    for first, then in ((OVERLAP_COPY_GRID, green), (green, OVERLAP_COPY_GRID)):
        assert_same(one, decode(2, "cuda", True, kernels, weights, first, 8, switch_to=then))


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [2, 3])
def test_part_tail_graphed_bitwise_on_gpu(parts):
    """--decode-part-tail: each part's tail right after its attention, inside the captured
    graph beside the side-stream copy, equals one eager batch whose tail splits alike (same
    bucket, so the same GEMM shapes; the split, not the backend, decides them)."""
    kernels, weights = KernelSet.triton(), random_weights(CFG, seed=3, device="cuda")
    one = decode(1, "cuda", False, kernels, weights, bucket=8, tail_parts=parts)
    assert one[3]["misses"] > 0
    assert_same(one, decode(parts, "cuda", True, kernels, weights, bucket=8, tail_parts=parts))


# Bench attention shapes (k 2048, B 4096, split-k attention, segmented top-k) on 2 layers.
BENCH_CFG = preset("bench", num_layers=2, mlp_hidden=1024, vocab_size=4096)
BENCH_LAYOUT = KVLayout(
    num_layers=2,
    max_requests=8,
    hot_slots=4096,
    window=128,
    topk=2048,
    page_size=64,
    num_pages=1024,
    max_context=16384,
)


@pytest.mark.gpu
def test_microbatches_graphed_bitwise_at_bench_shapes():
    kernels = KernelSet.triton()
    weights = random_weights(BENCH_CFG, seed=0, device="cuda")
    shapes = (BENCH_CFG, BENCH_LAYOUT, {0: 9000, 1: 5000, 2: 12000, 3: 3000})
    one = decode(1, "cuda", False, kernels, weights, shapes=shapes)
    assert one[3]["misses"] > 0
    for m in (2, 3, 4):
        assert_same(one, decode(m, "cuda", True, kernels, weights, bucket=8, shapes=shapes))


@pytest.mark.gpu
def test_part_tail_graphed_bitwise_at_bench_shapes():
    kernels = KernelSet.triton()
    weights = random_weights(BENCH_CFG, seed=0, device="cuda")
    shapes = (BENCH_CFG, BENCH_LAYOUT, {0: 9000, 1: 5000, 2: 12000, 3: 3000})
    for m in (2, 3):
        one = decode(1, "cuda", False, kernels, weights, bucket=8, shapes=shapes, tail_parts=m)
        assert one[3]["misses"] > 0
        two = decode(m, "cuda", True, kernels, weights, bucket=8, shapes=shapes, tail_parts=m)
        assert_same(one, two)
