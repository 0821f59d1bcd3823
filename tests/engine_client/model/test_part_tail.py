"""--decode-part-tail (Model.tail_parts, engine_client/model/part_tail.py): each decode part's
rows run their layer tail right after their own attention, before the next part joins its
miss copy; every KV mode splits its GEMMs the same way and stays bitwise equal to the others;
prefill chunks keep the whole-chunk tail. CPU: the reference kernels (the engine's CPU set)."""

from __future__ import annotations

import pytest
import torch

from contract.layout import MODE_OFFLOADED, KVLayout
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.part_tail import PartTails
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet
from kv_service.memory.store import allocate_local, reset_request
from tests.engine_client.model.test_model import (
    CFG,
    GPU_CFG,
    GPU_LAYOUT,
    LAYOUT,
    REQUESTS,
    admitted_tensors,
    gpu_run,
    make_backend,
    run_scenario,
)


def test_a_part_runs_once_the_attention_covered_its_rows() -> None:
    ran: list[slice] = []
    x = torch.zeros(5, 3)
    tails = PartTails(x, [slice(0, 2), slice(2, 5)], lambda r, out: (ran.append(r), out.fill_(1)))
    tails(1)
    assert ran == []
    tails(2)
    assert ran == [slice(0, 2)]
    tails(5)
    assert ran == [slice(0, 2), slice(2, 5)]
    assert torch.equal(tails.finish(), torch.ones(5, 3))
    # One attention part over the whole batch: both tails after it, in order.
    ran.clear()
    whole = PartTails(x, [slice(0, 2), slice(2, 5)], lambda r, out: ran.append(r))
    whole(5)
    assert ran == [slice(0, 2), slice(2, 5)]
    with pytest.raises(RuntimeError, match="never covered"):
        PartTails(x, [slice(0, 5)], lambda r, out: None).finish()


def _spied(model: Model, backend, events: list) -> None:
    """Records each select's and join's first row and each tail's rows, in launch order."""
    select, out_proj = backend.select, model._out_proj

    def spy_select(layer, topk, req_slots, seq_lens, row0=0, **kw):
        events.append(("select", row0))
        return select(layer, topk, req_slots, seq_lens, row0=row0, **kw)

    def spy_out_proj(lw, x, ws, r):
        events.append(("tail", r.start, r.stop))
        return out_proj(lw, x, ws, r)

    backend.select, model._out_proj = spy_select, spy_out_proj
    backend.attention_ready = lambda row0: events.append(("join", row0))


@pytest.mark.parametrize("tail_parts", [1, 2])
def test_the_first_part_tail_runs_before_the_second_part_joins_its_copy(tail_parts) -> None:
    kv = allocate_local(LAYOUT, "cpu")
    for slot in range(4):
        reset_request(kv, slot, MODE_OFFLOADED, list(range(slot * 6, slot * 6 + 6)))
    backend = HiSparseBackend(kv, kernels=KernelSet.reference(), microbatches=2)
    model = Model(CFG, random_weights(CFG, seed=3), backend, tail_parts=tail_parts)
    events: list = []
    _spied(model, backend, events)
    runner = ModelRunner(model, DecodeConfig(max_batch=4, buckets=(4,), use_graphs=False))
    runner.step([1, 2, 3], [20] * 3, [0, 1, 2], [21] * 3)
    selects = [("select", 0), ("select", 2)]
    if tail_parts == 2:
        layer = selects + [("join", 0), ("tail", 0, 2), ("join", 2), ("tail", 2, 4)]
    else:
        layer = selects + [("join", 0), ("join", 2), ("tail", 0, 4)]
    assert events == layer * CFG.num_layers


def _run_mode(mode: str, weights, tail_parts: int) -> tuple[list[torch.Tensor], list]:
    kernels = KernelSet.reference()
    if mode == "embedded":  # the only backend that attends in micro-batches
        backend = HiSparseBackend(admitted_tensors(), kernels=kernels, microbatches=2)
    else:
        backend = make_backend(mode, kernels)
    model = Model(CFG, weights, backend, tail_parts=tail_parts)
    tails: list = []
    out_proj = model._out_proj
    model._out_proj = lambda lw, x, ws, r: tails.append((r.start, r.stop)) or out_proj(lw, x, ws, r)
    runner = ModelRunner(model, DecodeConfig(max_batch=4, buckets=(4,)))
    return run_scenario(model, runner), tails


def test_every_mode_splits_its_tail_alike_and_stays_bitwise_equal() -> None:
    """Tail parts come from the model, not the backend: the baseline and remote swap (one
    attention part) run the same two tail parts per decode layer as embedded (two)."""
    weights = random_weights(CFG, seed=3)
    base, base_tails = _run_mode("baseline", weights, 2)
    # Prefill chunks (one per request here: chunks of 5 rows or fewer) keep a whole tail.
    chunks = [(0, n) for _, p in REQUESTS.values() for n in _chunk_rows(len(p), 5)]
    decode = [(0, 2), (2, 4)] * 3  # MAX_NEW steps, bucket 4
    per_layer = [t for t in chunks + decode for _ in range(CFG.num_layers)]
    assert sorted(base_tails) == sorted(per_layer)
    for mode in ("embedded", "remote"):
        logits, tails = _run_mode(mode, weights, 2)
        assert tails == base_tails, mode
        for i, (a, b) in enumerate(zip(base, logits)):
            assert torch.equal(a, b), f"{mode}: output {i} differs by {(a - b).abs().max()}"


def _chunk_rows(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - s) for s in range(0, n, chunk)]


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_gpu_modes_and_graphs_identical_with_the_part_tail(row_format) -> None:
    """As test_model's GPU test, with the part tail on: embedded attends in two parts on a
    side stream, graphed and eager; every mode equals the eager baseline bit for bit."""
    layout = KVLayout(**(GPU_LAYOUT.to_dict() | {"row_format": row_format}))
    weights = random_weights(GPU_CFG, seed=0, device="cuda")
    ref = gpu_run("baseline", False, weights, layout, tail_parts=2)
    for mode, graphs in (("baseline", True), ("embedded", False), ("embedded", True)):
        got = gpu_run(mode, graphs, weights, layout, tail_parts=2)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"{mode} graphs={graphs}: output {i} differs"
    got = gpu_run("remote", True, weights, layout, tail_parts=2)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "remote"
