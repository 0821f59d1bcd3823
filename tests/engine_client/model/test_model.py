"""The decode model over every in-process KV backend: bitwise-identical logits, padding rows that
change nothing, prefill chunking that changes nothing. Real kernel wrappers (Triton's interpreter
on CPU), tiny shapes: each token-layer costs ~0.1 s of interpreted kernels, so scenarios are short.
"""

from __future__ import annotations

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.tensors import TENSOR_NAMES
from engine_client.kv.backend import KVBackend
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.kv.remote_swap import RemoteSwapBackend, allocate_exchange, local_swap_fn
from engine_client.model.forward_batch import Tokens
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import preset
from engine_client.model.weights import random_weights
from engine_client.model.workspace import Workspace
from kernels.attention.sparse import TileWorkspace
from kernels.kit.kernel_set import KernelSet
from kv_service.memory.store import allocate_local, reset_request

CFG = preset("tiny", topk=8)
# B = 9 hot slots, W = 1: the LRU region holds exactly k rows, so a changing top-k evicts.
LAYOUT = KVLayout(
    num_layers=2,
    max_requests=4,
    hot_slots=9,
    window=1,
    topk=8,
    page_size=4,
    num_pages=24,
    max_context=48,
)
MAX_NEW = 3
# slot: (synthetic context, prompt). Slot 0 is resident (4 + 3 <= B); slot 1 has a synthetic
# 30-token context that only the host tier holds; slot 2 is offloaded through a real prefill.
REQUESTS = {
    0: (0, [5, 17, 33, 2]),
    1: (30, [9, 200, 41]),
    2: (0, [(37 * i) % 251 for i in range(13)]),
}


@pytest.fixture(scope="module")
def kernels() -> KernelSet:
    return KernelSet.triton()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CFG, seed=3)


def admitted_tensors(layout: KVLayout = LAYOUT, requests=REQUESTS):
    """Service memory with every request admitted the way kv_service does it."""
    kv = allocate_local(layout)
    next_page = 0
    for slot, (ctx, prompt) in requests.items():
        total = ctx + len(prompt) + MAX_NEW
        pages = list(range(next_page, next_page + layout.pages_for(total)))
        next_page += len(pages)
        reset_request(
            kv, slot, MODE_RESIDENT if total <= layout.hot_slots else MODE_OFFLOADED, pages
        )
    return kv


def make_backend(
    mode: str, kernels: KernelSet, layout: KVLayout = LAYOUT, requests=REQUESTS
) -> KVBackend:
    if mode == "baseline":
        return BaselineBackend(layout, kernels=kernels)
    kv = admitted_tensors(layout, requests)
    if mode == "embedded":
        return HiSparseBackend(kv, kernels=kernels)
    xchg = allocate_exchange(layout)
    return RemoteSwapBackend(kv, local_swap_fn(kv, xchg, kernels), kernels=kernels, xchg=xchg)


def run_scenario(model: Model, runner: ModelRunner, chunk: int = 5) -> list[torch.Tensor]:
    """Synthetic fill, chunked prefill, then MAX_NEW greedy decode steps of all requests."""
    out, last = [], {}
    for slot, (ctx, prompt) in REQUESTS.items():
        if ctx:
            model.backend.fill_synthetic(slot, ctx, seed=slot, chunk=16)
        logits = model.prefill(slot, prompt, start=ctx, chunk_size=chunk)
        out.append(logits.clone())
        last[slot] = int(logits.argmax())
    slots = list(REQUESTS)
    for step in range(MAX_NEW):
        pos = [REQUESTS[s][0] + len(REQUESTS[s][1]) + step for s in slots]
        logits = runner.step([last[s] for s in slots], pos, slots, [p + 1 for p in pos])
        out.append(logits.clone())
        last = {s: int(logits[i].argmax()) for i, s in enumerate(slots)}
    return out


# Buckets differ per mode, so padding rows (bucket 4 for 3 requests) are exercised too.
MODES = {"baseline": (3,), "embedded": (4,), "remote": (2, 4)}


@pytest.fixture(scope="module")
def runs(kernels, weights) -> dict[str, tuple[list[torch.Tensor], dict]]:
    results = {}
    for mode, buckets in MODES.items():
        backend = make_backend(mode, kernels)
        model = Model(CFG, weights, backend)
        runner = ModelRunner(model, DecodeConfig(max_batch=buckets[-1], buckets=buckets))
        results[mode] = (run_scenario(model, runner), backend.stats())
    return results


def test_modes_give_bitwise_identical_logits(runs) -> None:
    base, _ = runs["baseline"]
    assert len(base) == len(REQUESTS) + MAX_NEW
    assert all(torch.isfinite(x).all() for x in base)
    for mode in ("embedded", "remote"):
        logits, _ = runs[mode]
        for i, (a, b) in enumerate(zip(base, logits)):
            assert torch.equal(a, b), f"{mode}: output {i} differs by {(a - b).abs().max()}"


def test_offloaded_requests_miss_and_evict(runs) -> None:
    stats = runs["embedded"][1]
    assert stats == runs["remote"][1]
    # 3 rows x 2 layers x MAX_NEW steps select min(k, seq_len) positions each.
    assert stats["selected"] == 2 * sum(
        min(8, ctx + len(p) + s + 1) for ctx, p in REQUESTS.values() for s in range(MAX_NEW)
    )
    # More misses than the LRU slots of the 2 offloaded requests x 2 layers: rows were evicted.
    assert stats["misses"] > 2 * 2 * LAYOUT.lru_slots
    assert stats["miss_bytes"] == stats["misses"] * 1152


def test_prefill_chunk_size_does_not_change_logits(kernels, weights) -> None:
    prompt = REQUESTS[2][1][:9]
    results = []
    for chunk in (9, 4, 1):
        model = Model(CFG, weights, make_backend("baseline", kernels))
        results.append(model.prefill(2, prompt, chunk_size=chunk))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def state_of(backend: HiSparseBackend) -> dict[str, torch.Tensor]:
    return {name: getattr(backend.kv, name).clone() for name in TENSOR_NAMES} | {
        "counters": backend.counters.clone()
    }


def test_padding_rows_change_nothing(kernels, weights) -> None:
    backend = make_backend("embedded", kernels)
    model = Model(CFG, weights, backend)
    backend.fill_synthetic(1, 30, seed=1, chunk=16)
    before = state_of(backend)
    n = 2
    dev = backend.device
    # Padding rows with arbitrary token ids and positions: only the request slot -1 matters.
    tok = Tokens(
        ids=torch.tensor([7, 3]),
        req_slots=torch.full((n,), -1, dtype=torch.int32),
        positions=torch.tensor([5, 40], dtype=torch.int32),
        seq_lens=torch.zeros(n, dtype=torch.int32),
        append_lens=torch.zeros(n, dtype=torch.int32),
    )
    model.forward(tok, Workspace.allocate(CFG, n, LAYOUT.max_context, dev))
    after = state_of(backend)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_attention_workspaces_match_the_single_pass(kernels, weights) -> None:
    backend = make_backend("baseline", kernels)
    model = Model(CFG, weights, backend)
    backend.fill_synthetic(1, 30, seed=1, chunk=16)
    one = torch.ones(1, dtype=torch.int32)
    tok = Tokens(
        ids=torch.tensor([7]),
        req_slots=one,
        positions=one * 30,
        seq_lens=one * 31,
        append_lens=one * 31,
    )
    logits = []
    # Fused single pass, fused split-k, and the decode default (two-pass, tile scratch).
    for splits in (1, 3, None):  # re-appending the same token stores the same bytes
        ws = Workspace.allocate(CFG, 1, LAYOUT.max_context, backend.device, attn_splits=splits)
        assert (ws.attn_scratch is None) == (splits == 1)
        assert isinstance(ws.attn_scratch, TileWorkspace) == (splits is None)
        logits.append(model.logits(model.forward(tok, ws)))
    for other in logits[1:]:
        assert ((logits[0] - other).norm() / logits[0].norm()) < 1e-2


def test_decode_rejects_bad_batches(kernels, weights) -> None:
    model = Model(CFG, weights, make_backend("baseline", kernels))
    runner = ModelRunner(model, DecodeConfig(max_batch=2))
    for args in (
        ([1, 2], [3, 4], [0, 0], [4, 5]),  # duplicate slot
        ([1], [3], [0], [3]),  # seq_len != position + 1
        ([1], [48], [0], [49]),  # past max_context
        ([1, 2, 3], [1, 2, 3], [0, 1, 2], [2, 3, 4]),  # over max_batch
        ([CFG.vocab_size], [3], [0], [4]),
    ):  # token id out of vocab
        with pytest.raises(ValueError):
            runner.step(*args)
    with pytest.raises(ValueError):
        model.prefill(0, [1] * 49)
    with pytest.raises(ValueError):
        DecodeConfig(max_batch=4, buckets=(2, 3))


def test_decode_config_buckets() -> None:
    cfg = DecodeConfig(max_batch=6)
    assert cfg.buckets == (1, 2, 4, 6)
    assert [cfg.bucket(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


# --- GPU: bench attention shapes on 2 layers, graphs vs eager ---

GPU_CFG = preset("bench", num_layers=2, mlp_hidden=1024, vocab_size=4096)
GPU_LAYOUT = KVLayout(
    num_layers=2,
    max_requests=4,
    hot_slots=4096,
    window=128,
    topk=2048,
    page_size=64,
    num_pages=512,
    max_context=16384,
)


def gpu_run(
    mode: str, use_graphs: bool, weights, layout: KVLayout = GPU_LAYOUT, tail_parts: int = 1
) -> list[torch.Tensor]:
    """tail_parts > 1: the model's part tail, and embedded attends in that many micro-batches."""
    kernels = KernelSet.triton()
    reqs = {0: (0, 1000), 1: (9000, 1200), 2: (5000, 900)}
    if mode == "baseline":
        backend = BaselineBackend(layout, kernels=kernels, device="cuda")
    else:
        kv = allocate_local(layout, "cuda")
        for slot, (ctx, n) in reqs.items():
            total = ctx + n + 8
            mode_ = MODE_RESIDENT if total <= layout.hot_slots else MODE_OFFLOADED
            reset_request(
                kv, slot, mode_, list(range(slot * 170, slot * 170 + layout.pages_for(total)))
            )
        if mode == "embedded":
            backend = HiSparseBackend(kv, kernels=kernels, microbatches=tail_parts)
        else:
            xchg = allocate_exchange(layout, "cuda")
            backend = RemoteSwapBackend(
                kv, local_swap_fn(kv, xchg, kernels), kernels=kernels, xchg=xchg
            )
    model = Model(GPU_CFG, weights, backend, tail_parts=tail_parts)
    runner = ModelRunner(model, DecodeConfig(max_batch=4, use_graphs=use_graphs))
    gen = torch.Generator().manual_seed(0)
    out, last = [], {}
    for slot, (ctx, n) in reqs.items():
        if ctx:
            backend.fill_synthetic(slot, ctx, seed=slot)
        prompt = torch.randint(0, GPU_CFG.vocab_size, (n,), generator=gen).tolist()
        out.append(model.prefill(slot, prompt, start=ctx, chunk_size=512).clone())
        last[slot] = int(out[-1].argmax())
    slots = list(reqs)
    for step in range(8):
        pos = [reqs[s][0] + reqs[s][1] + step for s in slots]
        logits = runner.step([last[s] for s in slots], pos, slots, [p + 1 for p in pos])
        out.append(logits.clone())
        last = {s: int(logits[i].argmax()) for i, s in enumerate(slots)}
    assert runner.use_graphs == (use_graphs and mode != "remote")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_gpu_modes_and_graphs_identical(row_format) -> None:
    layout = KVLayout(**(GPU_LAYOUT.to_dict() | {"row_format": row_format}))
    weights = random_weights(GPU_CFG, seed=0, device="cuda")
    ref = gpu_run("baseline", False, weights, layout)
    for mode, graphs in (
        ("baseline", True),
        ("embedded", False),
        ("embedded", True),
        ("remote", True),
    ):
        got = gpu_run(mode, graphs, weights, layout)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"{mode} graphs={graphs}: output {i} differs"
