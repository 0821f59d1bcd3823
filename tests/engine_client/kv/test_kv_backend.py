"""KV backends: index-key encoding, row addressing of every store, prefill gathers, padding rows,
fp8 index keys across modes, and RemoteSwapBackend against the service's own RemoteSwapper."""

from __future__ import annotations

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from contract.tensors import TENSOR_NAMES
from engine_client.kv.backend import KVBackend
from engine_client.kv.baseline import BaselineBackend, baseline_layout
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.kv.remote_swap import RemoteSwapBackend, allocate_exchange, local_swap_fn
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import preset
from engine_client.model.weights import random_weights
from kernels.formats import BF16_KEYS, INDEX_FORMATS
from kernels.kit.kernel_set import KernelSet
from kernels.reference import read_index_rows
from kv_service.memory.remote_swap import RemoteSwapper
from kv_service.memory.store import allocate_local, reset_request

CFG = preset("tiny", topk=8)
LAYOUT = KVLayout(
    num_layers=2,
    max_requests=3,
    hot_slots=12,
    window=2,
    topk=8,
    page_size=4,
    num_pages=24,
    max_context=40,
)
# slot: (mode, context length); pages are deliberately not in slot order.
REQS = {0: (MODE_RESIDENT, 7), 2: (MODE_OFFLOADED, 27)}
PAGES = {0: [20, 21, 22], 2: [5, 3, 11, 0, 1, 2, 9, 8, 7, 6]}
KERNELS = KernelSet.triton()


def service_tensors(layout: KVLayout = LAYOUT):
    kv = allocate_local(layout)
    for slot, (mode, _) in REQS.items():
        reset_request(kv, slot, mode, PAGES[slot])
    return kv


def fp8_layout(row_format: str = "bf16") -> KVLayout:
    return KVLayout(**(LAYOUT.to_dict() | {"index_format": "fp8", "row_format": row_format}))


def filled(layout: KVLayout = LAYOUT):
    base = BaselineBackend(layout, kernels=KERNELS)
    hs = HiSparseBackend(service_tensors(layout), kernels=KERNELS)
    for backend in (base, hs):
        for slot, (_, n) in REQS.items():
            backend.fill_synthetic(slot, n, seed=slot, chunk=5)
    return base, hs


@pytest.mark.parametrize("fmt,nbytes", [("bf16", 256), ("fp8", 132)])
def test_index_key_encoding_round_trips(fmt, nbytes) -> None:
    keys = torch.randn(6, 128) * torch.tensor([0.01, 1, 3, 100, 0, 1])[:, None]
    rows = INDEX_FORMATS[fmt].encode(keys)
    assert rows.shape == (6, nbytes) and rows.dtype == torch.uint8
    ours = INDEX_FORMATS[fmt].decode(rows)
    tol = 0 if fmt == "bf16" else 0.07
    assert torch.allclose(
        ours, keys.bfloat16().float(), rtol=tol, atol=tol * keys.abs().amax(1, keepdim=True).max()
    )
    assert torch.isfinite(ours).all() and (ours[4] == 0).all()
    if fmt == "fp8":
        scale = rows[:, 128:].contiguous().view(torch.float32)[:, 0]
        assert torch.allclose(scale[:4], keys[:4].abs().amax(1) / 448)


@pytest.mark.parametrize(
    "lay", [LAYOUT, fp8_layout(), fp8_layout("fp8")], ids=["bf16", "fp8-keys", "fp8-keys-fp8-rows"]
)
def test_synthetic_fill_lands_at_every_store_address(lay) -> None:
    base, hs = filled(lay)
    kv = hs.kv
    host = kv.host_kv.view(-1, lay.row_bytes)
    for layer in range(lay.num_layers):
        for slot, (mode, n) in REQS.items():
            want = base.full_kv[layer, slot, :n].contiguous().view(torch.uint8)
            for t in range(n):
                if mode == MODE_RESIDENT:
                    got = kv.hot_kv[layer, slot, t]
                else:
                    page = PAGES[slot][t // lay.page_size]
                    got = host[(page * lay.num_layers + layer) * lay.page_size + t % lay.page_size]
                assert torch.equal(got, want[t]), (layer, slot, t)
            if mode == MODE_OFFLOADED:
                # The window ring holds the newest W tokens.
                for t in range(n - lay.window, n):
                    assert torch.equal(kv.hot_kv[layer, slot, t % lay.window], want[t])
    # Same index keys under both page tables.
    for slot, (_, n) in REQS.items():
        t = torch.arange(n)
        pages = torch.tensor(PAGES[slot])[t // lay.page_size]
        base_pages = base.page_table[slot, t // lay.page_size].long()
        assert torch.equal(
            read_index_rows(kv.index_pool[1], pages, t % lay.page_size, lay.index),
            read_index_rows(base.index_pool_layer(1), base_pages, t % lay.page_size, lay.index),
        )
        # Whole pages are byte-identical: the baseline's tensor stores and kv_append agree on
        # the physical page layout (page-blocked for fp8 keys).
        for p in range(n // lay.page_size):
            assert torch.equal(
                kv.index_pool[1, PAGES[slot][p]], base.index_pool_layer(1)[base.page_table[slot, p]]
            )


@pytest.mark.parametrize("lay", [LAYOUT, fp8_layout("fp8")], ids=["bf16", "fp8-rows"])
def test_prefill_gather_reads_the_same_rows_and_moves_no_state(lay) -> None:
    base, hs = filled(lay)
    before = {name: getattr(hs.kv, name).clone() for name in TENSOR_NAMES if name != "hot_kv"}
    # 3 chunk tokens x 8 < 27 positions: per-token reads; 5 x 8 >= 27: one read of the context.
    for slot, (_, n), rows in [(s, r, m) for s, r in REQS.items() for m in (3, 5)]:
        # Ascending valid positions, -1 padded (what topk_select produces), one row per chunk token.
        topk = torch.full((rows, 8), -1, dtype=torch.int32)
        for b in range(rows):
            m = max(1, n - 6 * b)
            picked = torch.randperm(m)[: min(8, m)].sort().values
            topk[b, : len(picked)] = picked.int()
        a, h = base.gather(1, topk, slot, n), hs.gather(1, topk, slot, n)
        for b in range(rows):
            for i in range(8):
                if topk[b, i] >= 0:
                    assert torch.equal(
                        a.kv[a.row_base[b] + a.slots[b, i]], h.kv[h.row_base[b] + h.slots[b, i]]
                    )
                else:
                    assert a.slots[b, i] < 0 and h.slots[b, i] < 0
    for name, t in before.items():
        assert torch.equal(t, getattr(hs.kv, name)), name
    with pytest.raises(ValueError, match="not admitted"):
        hs.gather(0, torch.zeros((1, 8), dtype=torch.int32), 1, 1)


def test_padding_rows_write_nothing() -> None:
    for backend in (
        BaselineBackend(LAYOUT, kernels=KERNELS),
        HiSparseBackend(service_tensors(), kernels=KERNELS),
    ):
        store = backend.full_kv if isinstance(backend, BaselineBackend) else backend.kv.host_kv
        pools = [backend.index_pool_layer(layer).clone() for layer in range(2)]
        rows = torch.randn(2, 576).bfloat16()
        slots = torch.tensor([-1, 0], dtype=torch.int32)
        pos = torch.tensor([0, 1], dtype=torch.int32)
        # Row 1 is real but its position is not < seq_len: also skipped.
        backend.append(
            0,
            rows,
            BF16_KEYS.encode(torch.randn(2, 128)),
            slots,
            pos,
            torch.tensor([5, 1], dtype=torch.int32),
        )
        assert not store.any()
        assert all(torch.equal(p, backend.index_pool_layer(i)) for i, p in enumerate(pools))


def decode_only(backend, steps: int = 3) -> list[torch.Tensor]:
    """Greedy decode from synthetic contexts (no prefill: cheap under the interpreter)."""
    for slot, (_, n) in REQS.items():
        backend.fill_synthetic(slot, n, seed=slot, chunk=8)
    model = Model(CFG, random_weights(CFG, seed=4), backend)
    runner = ModelRunner(model, DecodeConfig(max_batch=2))
    slots = list(REQS)
    tokens, out = [1, 2], []
    for step in range(steps):
        pos = [REQS[s][1] + step for s in slots]
        logits = runner.step(tokens, pos, slots, [p + 1 for p in pos])
        out.append(logits.clone())
        tokens = logits.argmax(dim=1).tolist()
    return out


def remote_with_service_swapper(kv) -> RemoteSwapBackend:
    xchg = allocate_exchange(kv.layout)
    swapper = RemoteSwapper(kv, xchg)
    swapper.claim("session")
    return RemoteSwapBackend(
        kv,
        lambda layer, bs, rows: swapper.run("session", layer, bs, set(REQS), rows),
        kernels=KERNELS,
        xchg=xchg,
        max_batch=2,
    )


@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_fp8_index_keys_identical_across_modes(row_format) -> None:
    lay = fp8_layout(row_format)
    base = BaselineBackend(lay, kernels=KERNELS)
    assert base.index_pool_layer(0).shape[-1] == 132
    hs = HiSparseBackend(service_tensors(lay), kernels=KERNELS, max_batch=2)
    remote = remote_with_service_swapper(service_tensors(lay))
    results = [decode_only(b) for b in (base, hs, remote)]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    stats = hs.stats()
    assert stats == remote.stats() and stats["misses"] > 0
    assert stats["hits"] + stats["misses"] == stats["selected"] == 2 * 3 * 2 * 8
    hs.reset_stats()
    assert hs.stats()["selected"] == 0


def test_every_backend_is_a_kv_backend() -> None:
    """The declared interface (KVBackend) is all callers use; each backend has all of it, and
    counts per request slot itself (no wrapper)."""
    kv = service_tensors()
    backends = [
        BaselineBackend(LAYOUT, kernels=KERNELS),
        HiSparseBackend(kv, kernels=KERNELS),
        remote_with_service_swapper(service_tensors()),
    ]
    topk = torch.tensor([[0, 1, 2, -1, -1, -1, -1, -1], [4, 5, 6, 7, 8, 9, 10, 11]]).int()
    slots, lens = torch.tensor([0, 2]).int(), torch.tensor([7, 27]).int()
    for backend in backends:
        assert isinstance(backend, KVBackend), type(backend)
        backend.select(1, topk, slots, lens)
        assert backend.counts[0, 0] == 3 and backend.counts[2, 0] == 8, type(backend)
        assert backend.counts[1].tolist() == [0, 0, 0]
    # Slot 2 is offloaded and nothing of it was filled: its 8 positions are all misses.
    assert [b.counts[2, 1:].tolist() for b in backends] == [[0, 0], [8, 8], [8, 8]]


def test_backend_arguments_are_checked() -> None:
    kv = service_tensors()
    with pytest.raises(ValueError, match="max_batch"):
        HiSparseBackend(kv, kernels=KERNELS, max_batch=4)
    xchg = allocate_exchange(LAYOUT)
    swap = local_swap_fn(kv, xchg, KERNELS)
    bad = dict(xchg, xchg_topk=torch.zeros((3, 4), dtype=torch.int32))
    with pytest.raises(ValueError, match="xchg_topk"):
        RemoteSwapBackend(kv, swap, kernels=KERNELS, xchg=bad)
    with pytest.raises(ValueError, match="events"):
        RemoteSwapBackend(kv, swap, kernels=KERNELS, xchg=xchg, events={"ready": None})
    assert not RemoteSwapBackend(kv, swap, kernels=KERNELS).capturable
    with pytest.raises(ValueError, match="index_format"):
        baseline_layout(num_layers=1, max_requests=1, max_context=8, topk=4, index_format="int4")
