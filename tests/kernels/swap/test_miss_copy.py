"""miss_copy against its reference, and the whole swap-in path end to end: append, plan, copy,
then every selected slot holds the selected token's true row."""

from __future__ import annotations

import random

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from kernels.reference import ref_miss_copy
from kernels.store.append import kv_append
from kernels.swap import miss_copy as miss_copy_module
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.miss_copy import miss_copy
from kernels.swap.plan import swap_plan
from kernels.uva import UVATensor
from kv_service.memory.store import allocate_local, reset_request

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GUARD = 64
SENTINEL = 0x5A


def rows_tensor(shape, device, g, pinned=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8 rows inside a buffer with sentinel guard bands: (view, buffer)."""
    n = torch.Size(shape).numel()
    buf = torch.full((n + 2 * GUARD,), SENTINEL, dtype=torch.uint8, pin_memory=pinned)
    buf[GUARD : GUARD + n] = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    buf = buf if pinned else buf.to(device)
    return buf[GUARD : GUARD + n].view(shape), buf


def miss_lists(rng, bs, k, host_n, hot_n, device):
    """Distinct destinations over the batch, some out-of-range rows, counts in [0, k] and beyond."""
    dst = rng.sample(range(hot_n), bs * k)
    src = [rng.randrange(host_n) for _ in range(bs * k)]
    for j in rng.sample(range(bs * k), bs * k // 8):
        src[j], dst[j] = rng.choice(
            [(-1, dst[j]), (host_n, dst[j]), (src[j], hot_n), (src[j], -(2**40)), (2**62, dst[j])]
        )
    counts = [rng.choice([0, k, rng.randint(0, k), rng.randint(0, k)]) for _ in range(bs)]
    if bs > 1:
        counts[1] = 2**31 - 1
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return (
        as_t(src, torch.int64).view(bs, k),
        as_t(dst, torch.int64).view(bs, k),
        as_t(counts, torch.int32),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [1152, 656, 20])
@pytest.mark.parametrize("bs", [1, 3, 17])
def test_copy_matches_reference(device, D, bs):
    rng, g = random.Random(bs + D), torch.Generator().manual_seed(bs)
    k = 13
    on_gpu = torch.device(device).type == "cuda"
    host, _ = rows_tensor((7, 2, 5, D), device, g, pinned=on_gpu)
    hot, hot_buf = rows_tensor((2, 19, 6, D), device, g)
    want = hot_buf.clone()
    src, dst, count = miss_lists(rng, bs, k, 70, 228, device)
    miss_copy(UVATensor(host) if on_gpu else host, hot, src, dst, count)
    ref_miss_copy(host, want[GUARD:-GUARD].view(hot.shape), src, dst, count)
    assert torch.equal(hot_buf, want)
    assert (hot_buf[:GUARD] == SENTINEL).all() and (hot_buf[-GUARD:] == SENTINEL).all()


def _check_copy(device, D, bs, k, counts, seed=0, **kw):
    """One miss_copy (keywords kw) on poisoned, guarded buffers against ref_miss_copy."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    on_gpu = torch.device(device).type == "cuda"
    host_n, hot_n = 3 * bs * k + 5, 2 * bs * k + 7
    host, _ = rows_tensor((host_n, D), device, g, pinned=on_gpu)
    hot, hot_buf = rows_tensor((hot_n, D), device, g)
    want = hot_buf.clone()
    src, dst, _ = miss_lists(rng, bs, k, host_n, hot_n, device)
    count = torch.tensor(counts, dtype=torch.int32, device=device)
    miss_copy(
        UVATensor(host) if on_gpu else host,
        hot,
        src,
        dst,
        count,
        **kw,
    )
    ref_miss_copy(host, want[GUARD:-GUARD].view(hot.shape), src, dst, count)
    assert torch.equal(hot_buf, want)
    assert (hot_buf[:GUARD] == SENTINEL).all() and (hot_buf[-GUARD:] == SENTINEL).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["none", "full", "one", "padding", "negative"])
@pytest.mark.parametrize("programs", [None, 1, 3])
def test_work_list_patterns(device, pattern, programs):
    """Every count pattern the plan can write, walked by grids smaller and larger than the
    work list: no misses, every list full, one busy request among empty ones, padding rows
    (count 0 with garbage lists) and negative or oversized counts."""
    bs, k = 6, 11
    counts = {
        "none": [0] * bs,
        "full": [k] * bs,
        "one": [0, 0, 0, 7, 0, 0],
        "padding": [k, 3, 0, 0, 0, 0],
        "negative": [-5, 2**31 - 1, -(2**31), 4, k + 1, 1],
    }
    _check_copy(device, 656, bs, k, counts[pattern], programs=programs, seed=len(pattern))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,k,chunk_bytes", [(300, 3, 128), (257, 5, 256), (1, 37, 16)])
def test_batch_past_one_scan_block(device, bs, k, chunk_bytes):
    """More requests than one vector step of the count scans (BATCH_BLOCK), and a single
    long list, with random counts."""
    rng = random.Random(bs)
    counts = [rng.choice([0, k, rng.randint(0, k)]) for _ in range(bs)]
    _check_copy(device, 20, bs, k, counts, chunk_bytes=chunk_bytes, seed=bs)


GRIDS = [
    CopyGrid(programs=1),
    CopyGrid(programs=5, bytes_per_program=3 * 656, min_programs=2),
    CopyGrid(programs=7, bytes_per_program=1),  # one row per working CTA
    CopyGrid(programs=6, bytes_per_program=1 << 30, min_programs=6),  # min wins
    CopyGrid(programs=2, bytes_per_program=1 << 30, min_programs=9),  # min above the launch
    CopyGrid(bytes_per_program=5 * 656, min_programs=3),  # the default launch, a rule
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "grid",
    [
        CopyGrid(programs=3, chunk_bytes=256, warps=1),
        CopyGrid(5, 2 * 656, 2, chunk_bytes=1024, warps=8, prefetch=True),
        CopyGrid(programs=4, chunk_bytes=64 << 10, warps=32),
        CopyGrid(chunk_bytes=16, warps=2, prefetch=True),  # the default launch, one vector
    ],
    ids=lambda g: g.label(),
)
def test_the_grids_iteration_writes_the_same_bytes(device, grid):
    """The grid carries the whole launch: its chunk, warps and prefetch move the reference's
    bytes as the keywords did, and a keyword still overrides the grid's."""
    bs, k, counts = 7, 9, [1, 0, 9, -3, 5, 2**31 - 1, 4]
    # 656-byte rows (41 vectors); on CPU 112-byte rows (7) for the one-vector chunk, whose walk
    # is an interpreted iteration per vector (41 a row cost 7 s of CPU). 7 vectors are still no
    # multiple of the override's 4, and a row still spans iterations.
    row = 112 if grid.chunk_bytes == 16 and device == "cpu" else 656
    _check_copy(device, row, bs, k, counts, seed=3, grid=grid)
    _check_copy(device, row, bs, k, counts, seed=4, grid=grid, chunk_bytes=64, prefetch=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.label())
@pytest.mark.parametrize("pattern", ["none", "full", "ragged"])
def test_every_grid_writes_the_same_bytes(device, grid, pattern):
    """Rows are independent: any launched grid, any rule for its working CTAs, any chunk (and
    prefetch) moves the reference's bytes. Irregular sizes: 656-byte rows (41 vectors), counts
    that leave requests empty, split a request between CTAs, or overflow k; out-of-range rows."""
    bs, k = 7, 9
    counts = {
        "none": [0] * bs,
        "full": [k] * bs,
        "ragged": [1, 0, k, -3, 5, 2**31 - 1, 4],
    }[pattern]
    # 16 vectors (chunks across rows) with and without the row-number prefetch; several rows.
    chunks = ((256, False), (256, True), (4096, False))
    if pattern == "full":  # the longest lists: 64 vectors with the prefetch, several rows
        chunks = ((1024, True), (4096, False))
    for chunk, prefetch in chunks:
        kw = dict(grid=grid, chunk_bytes=chunk, prefetch=prefetch)
        _check_copy(device, 656, bs, k, counts, seed=bs + chunk, **kw)


def test_the_launch_takes_the_grids_iteration(monkeypatch):
    """What reaches the kernel: the grid's chunk, warps and prefetch, each overridden only by
    an explicit keyword."""
    launches = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((grid, kw))

    monkeypatch.setattr(miss_copy_module, "_miss_copy_kernel", Spy())
    rows = torch.zeros((8, 656), dtype=torch.uint8)
    lists, count = torch.zeros((2, 3), dtype=torch.int64), torch.ones(2, dtype=torch.int32)
    grid = CopyGrid(5, 1 << 20, 2, chunk_bytes=64 << 10, warps=32, prefetch=True)
    miss_copy(rows, rows, lists, lists, count, grid=grid)
    miss_copy(rows, rows, lists, lists, count, grid=grid, chunk_bytes=256, num_warps=2)
    miss_copy(rows, rows, lists, lists, count, grid=grid, prefetch=False, programs=3)
    seen = [(g, kw["VECTORS"] * 16, kw["num_warps"], kw["PREFETCH"]) for g, kw in launches]
    assert seen == [((5,), 65536, 32, True), ((5,), 256, 2, True), ((3,), 65536, 32, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [1152, 656])
@pytest.mark.parametrize("bs", [1, 64, 174])
def test_real_shapes_default_grid(D, bs):
    """k 2048 and the engine's batch sizes on the default persistent grid, ~13% misses with
    some empty and some full lists; checked against an indexed torch copy."""
    k, host_n, hot_n = 2048, 1 << 17, bs * 4096
    g = torch.Generator().manual_seed(bs + D)
    host = torch.randint(0, 256, (host_n, D), dtype=torch.uint8, generator=g).pin_memory()
    hot = torch.zeros((hot_n, D), dtype=torch.uint8, device="cuda")
    counts = torch.randint(0, 2 * k * 13 // 100, (bs,), generator=g, dtype=torch.int32)
    counts[::7] = 0
    counts[3::11] = k
    src = torch.randint(0, host_n, (bs, k), generator=g)
    dst = torch.randperm(hot_n, generator=g)[: bs * k].view(bs, k)
    miss_copy(UVATensor(host), hot, src.cuda(), dst.cuda(), counts.cuda())
    live = torch.arange(k)[None, :] < counts[:, None].long()
    want = torch.zeros((hot_n, D), dtype=torch.uint8)
    want[dst[live]] = host[src[live]]
    assert torch.equal(hot.cpu(), want)


def test_rejects_bad_arguments():
    host = torch.zeros((4, 16), dtype=torch.uint8)
    hot = torch.zeros((4, 16), dtype=torch.uint8)
    src = torch.zeros((2, 3), dtype=torch.int64)
    count = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError):
        miss_copy(host, hot, src, src, count.long())
    with pytest.raises(ValueError):
        miss_copy(host, torch.zeros((4, 12), dtype=torch.uint8), src, src, count)
    with pytest.raises(ValueError):
        miss_copy(host, hot, src, src, count, programs=0)
    with pytest.raises(ValueError):
        miss_copy(host, hot, src, src, count, chunk_bytes=24)
    with pytest.raises(ValueError):
        miss_copy(host, hot, src, src, count, num_warps=3)


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
    swap_plan(
        layer,
        col(topk),
        col([seq.get(r, 0) for r in batch]),
        col(batch),
        kv.req_mode,
        kv.page_table,
        kv.token_slot,
        kv.slot_token,
        kv.lru_order,
        kv.hit_flag,
        *out,
        num_layers=lay.num_layers,
        page_size=lay.page_size,
        window=lay.window,
    )
    miss_copy(kv.host_rows, kv.hot_kv, out[1], out[2], out[3])
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
        swap_plan(
            1,
            topk,
            seq,
            req,
            kv.req_mode,
            kv.page_table,
            kv.token_slot,
            kv.slot_token,
            kv.lru_order,
            kv.hit_flag,
            *out,
            num_layers=2,
            page_size=8,
            window=4,
        )
        miss_copy(kv.host_rows, kv.hot_kv, out[1], out[2], out[3])

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
