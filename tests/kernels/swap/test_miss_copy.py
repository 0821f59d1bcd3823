"""miss_copy against its reference: work-list patterns, grids and their iterations, the
arguments it refuses (the whole swap-in path end to end: test_swap_in_path.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.reference import ref_miss_copy
from kernels.swap import miss_copy as miss_copy_module
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.miss_copy import miss_copy
from kernels.uva import UVATensor

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
        CopyGrid(programs=3, chunk_bytes=256, warps=2, stages=2),  # pipelined on a GPU
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
    miss_copy(rows, rows, lists, lists, count, grid=CopyGrid(4, stages=3))
    seen = [
        (g, kw["VECTORS"] * 16, kw["num_warps"], kw["PREFETCH"], kw["STAGES"]) for g, kw in launches
    ]
    assert seen == [
        ((5,), 65536, 32, True, 1),
        ((5,), 256, 2, True, 1),
        ((3,), 65536, 32, False, 1),
        ((4,), 8192, 4, False, 3),
    ]


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
