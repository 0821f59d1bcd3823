"""kv_append: exact equality with its reference, the row addresses of the contract, and rows
that must write nothing."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.formats import BF16_KEYS, BF16_ROW, FP8_KEYS, FP8_ROW, IndexFormat, RowFormat
from kernels.reference import ref_kv_append
from kernels.store.append import kv_append
from kernels.uva import UVATensor

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GUARD = 96
SENTINEL = 0xA5
L, R, B, W, P, PAGES, MAX_PAGES, MAPPED = 3, 5, 24, 3, 5, 40, 13, 8


def _no_codec(x: torch.Tensor) -> torch.Tensor:
    raise AssertionError("kv_append takes encoded index rows: it never encodes keys")


def formats(D: int, I: int) -> dict:
    """kv_append's format arguments for tiers of D-byte rows and I-byte keys: the registered
    formats of those sizes, else opaque ones (rows appended already encoded, keys unscaled)."""
    rows = {f.row_bytes: f for f in (BF16_ROW, FP8_ROW)}
    keys = {f.key_bytes: f for f in (BF16_KEYS, FP8_KEYS)}
    row = rows.get(D) or RowFormat(f"opaque{D}", D, "uint8", None, None, None)
    key = keys.get(I) or IndexFormat(f"opaque{I}", I, 0, _no_codec, _no_codec, None)
    return {"row_format": row, "index_format": key}


class Tiers:
    """host_kv, hot_kv and index_pool, each inside a buffer with sentinel guard bands."""

    def __init__(self, device, D: int, I: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        shapes = {"host": (PAGES, L, P, D), "hot": (L, R, B, D), "pool": (L, PAGES, P, I)}
        self.device, self.bufs, self.views = torch.device(device), {}, {}
        for name, shape in shapes.items():
            n = torch.Size(shape).numel()
            on_host = name == "host"
            buf = torch.full(
                (n + 2 * GUARD,),
                SENTINEL,
                dtype=torch.uint8,
                pin_memory=on_host and self.device.type == "cuda",
            )
            buf[GUARD : GUARD + n] = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
            buf = buf if on_host else buf.to(device)
            self.bufs[name], self.views[name] = buf, buf[GUARD : GUARD + n].view(shape)

    def args(self, uva: bool) -> tuple:
        host = self.views["host"]
        host = UVATensor(host) if uva and self.device.type == "cuda" else host
        return host, self.views["hot"], self.views["pool"]

    def snapshot(self) -> dict[str, torch.Tensor]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {n: b.cpu().clone() for n, b in self.bufs.items()}


def control(device, modes, seed):
    """req_mode and a page table of distinct pages; pages past MAPPED of each request unmapped."""
    g = torch.Generator().manual_seed(seed)
    mapped = torch.randperm(PAGES, generator=g)[: R * MAPPED].int().view(R, MAPPED)
    unmapped = torch.full((R, MAX_PAGES - MAPPED), -1, dtype=torch.int32)
    return (
        torch.tensor(modes, dtype=torch.int32, device=device),
        torch.cat([mapped, unmapped], 1).to(device),
    )


def append(fn, tiers: Tiers, layer, rows, req_mode, page_table, seed):
    """rows: [(req_slot, position, seq_len)]; KV/index bytes are random per row."""
    g = torch.Generator().manual_seed(seed)
    dev = tiers.device
    D, I = tiers.views["host"].shape[-1], tiers.views["pool"].shape[-1]
    kv = torch.randint(0, 256, (len(rows), D), generator=g, dtype=torch.uint8).to(dev)
    index = torch.randint(0, 256, (len(rows), I), generator=g, dtype=torch.uint8).to(dev)
    cols = (
        [torch.tensor(c, dtype=torch.int32, device=dev) for c in zip(*rows)]
        if rows
        else [torch.zeros(0, dtype=torch.int32, device=dev)] * 3
    )
    tier_args = tiers.args(fn is kv_append)
    fn(layer, kv, index, *cols, req_mode, page_table, *tier_args, window=W, **formats(D, I))
    return kv.cpu(), index.cpu()


def random_rows(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    """Distinct (slot, position) pairs, one seq_len per request; most rows valid, some bad."""
    seq = {r: rng.randint(0, MAPPED * P + 3) for r in range(R)}
    rows, used = [], set()
    while len(rows) < n:
        r = rng.choice(list(range(R)) * 4 + [-1, R, 2**31 - 1])
        s = seq.get(r, 9)
        t = (
            rng.choice(
                [
                    rng.randint(max(0, s - 2 * W), s - 1),
                    rng.randint(0, s - 1),
                    rng.randint(-2, s + 2),
                    2**31 - 1,
                ]
            )
            if s
            else rng.randint(-1, 1)
        )
        if (r, t) not in used:
            used.add((r, t))
            rows.append((r, t, s))
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D,I", [(656, 132), (1152, 256), (20, 12)])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_append_matches_reference(device, D, I, n):
    rng = random.Random(n * D)
    modes = rng.sample([0, 1, 2, 2, 1], R)
    req_mode, page_table = control(device, modes, n)
    rows = random_rows(rng, n)
    got, want = Tiers(device, D, I, seed=n), Tiers(device, D, I, seed=n)
    for layer in (0, L - 1):
        append(kv_append, got, layer, rows, req_mode, page_table, seed=layer)
        append(ref_kv_append, want, layer, rows, req_mode, page_table, seed=layer)
    a, b = got.snapshot(), want.snapshot()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_append_writes_contract_addresses(device):
    req_mode, page_table = control(device, [2, 1, 0, 0, 0], seed=5)
    pages = page_table.cpu()
    tiers = Tiers(device, 20, 12, seed=1)
    before = tiers.snapshot()
    # A 9-token prefill chunk of offloaded request 0 and 4 tokens of resident request 1.
    rows = [(0, t, 9) for t in range(9)] + [(1, t, 4) for t in range(4)]
    kv, index = append(kv_append, tiers, 2, rows, req_mode, page_table, seed=9)
    expect = {n: b.clone() for n, b in before.items()}
    host, hot, pool = (
        expect[n][GUARD : GUARD + tiers.views[n].numel()].view(tiers.views[n].shape)
        for n in ("host", "hot", "pool")
    )
    for i, (r, t, seq_len) in enumerate(rows):
        page = pages[r, t // P]
        pool[2, page, t % P] = index[i]
        if r == 0:
            host[page, 2, t % P] = kv[i]
            if t >= seq_len - W:
                hot[2, 0, t % W] = kv[i]
        else:
            hot[2, 1, t] = kv[i]
    after = tiers.snapshot()
    for n in expect:
        assert torch.equal(after[n], expect[n]), n


@pytest.mark.parametrize("device", DEVICES)
def test_bad_rows_write_nothing(device):
    req_mode, page_table = control(device, [2, 1, 0, 2, 1], seed=2)
    page_table[3].fill_(-1)
    page_table[4, 0] = PAGES + 3
    tiers = Tiers(device, 656, 132, seed=4)
    before = tiers.snapshot()
    big = 2**31 - 1
    rows = [
        (-1, 0, 5),
        (R, 0, 5),
        (big, 0, 5),
        (2, 0, 5),  # no request
        (0, -1, 5),
        (0, 5, 5),
        (0, 9, 5),
        (0, big, big),  # position outside [0, seq_len)
        (1, -(2**31), 3),
        (0, MAX_PAGES * P, big),
        (0, 3, -4),  # beyond the page table
        (3, 2, 7),
        (4, 1, 7),
    ]  # unmapped / bad page
    append(kv_append, tiers, 1, rows, req_mode, page_table, seed=3)
    append(kv_append, tiers, 0, [], req_mode, page_table, seed=3)
    after = tiers.snapshot()
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_index_rows_are_page_blocked(device):
    """132 B index rows (128 fp8 values + fp32 scale): a page holds its P rows of values, then
    its P scales, so every row's values start 16 B aligned."""
    req_mode, page_table = control(device, [2, 1, 0, 0, 0], seed=6)
    pages = page_table.cpu()
    tiers = Tiers(device, 20, 132, seed=2)
    before = tiers.snapshot()["pool"]
    rows = [(0, t, 9) for t in range(9)] + [(1, 3, 4)]
    _, index = append(kv_append, tiers, 1, rows, req_mode, page_table, seed=4)
    after = tiers.snapshot()["pool"]
    expect = before.clone()
    flat = expect[GUARD : GUARD + L * PAGES * P * 132].view(L, PAGES, P * 132)
    for i, (r, t, _) in enumerate(rows):
        j = t % P
        flat[1, pages[r, t // P], j * 128 : (j + 1) * 128] = index[i, :128]
        flat[1, pages[r, t // P], P * 128 + j * 4 : P * 128 + (j + 1) * 4] = index[i, 128:]
    assert torch.equal(after, expect)
