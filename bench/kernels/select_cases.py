"""Selection cases of bench/kernels/cli.py: indexer scores over the paged key pool (against the
same run's HBM copy rate) and top-k (against torch.topk)."""

from __future__ import annotations

import torch

from bench.kernels.kernel_cases import BS, C, K, P, sweep
from bench.shared.timing import Row, cpu_call_us, graph_time_us

# Per key format: (label, indexer keywords); the first is the default.
INDEXER_VARIANTS = {
    "bf16": [
        ("bt128 t4 w4 st3", dict(block_t=128, tiles=4, num_warps=4, num_stages=3)),
        ("bt128 t4 w4 st2", dict(block_t=128, tiles=4, num_warps=4, num_stages=2)),
        ("bt64 t8 w4 st4", dict(block_t=64, tiles=8, num_warps=4, num_stages=4)),
        ("bt256 t2 w8 st3", dict(block_t=256, tiles=2, num_warps=8, num_stages=3)),
        ("bt128 t8 w8 regpf", dict(block_t=128, tiles=8, num_warps=8, reg_prefetch=True)),
    ],
    "fp8": [
        ("bt128 t4 w4 regpf", dict(block_t=128, tiles=4, num_warps=4, reg_prefetch=True)),
        ("bt128 t4 w8 regpf", dict(block_t=128, tiles=4, num_warps=8, reg_prefetch=True)),
        ("bt256 t4 w8 regpf", dict(block_t=256, tiles=4, num_warps=8, reg_prefetch=True)),
        ("bt64 t8 w4 regpf", dict(block_t=64, tiles=8, num_warps=4, reg_prefetch=True)),
        (
            "bt128 t4 w4 st3",
            dict(block_t=128, tiles=4, num_warps=4, reg_prefetch=False, num_stages=3),
        ),
        # e4m3 x e4m3 (V3.2's indexer numerics): no key conversion; the sm_90 SASS has 8
        # QGMMA a tile for 16 HGMMA and 1,168 instructions against 1,320 (Triton 3.7.1).
        ("fp8q bt128 t4 w4 st3", dict(block_t=128, tiles=4, num_warps=4, query_fp8=True)),
        ("fp8q bt128 t4 w4 st2", dict(block_t=128, tiles=4, num_stages=2, query_fp8=True)),
        ("fp8q bt256 t4 w8 st3", dict(block_t=256, tiles=4, num_warps=8, query_fp8=True)),
        (
            "fp8q bt128 t4 w4 regpf",
            dict(block_t=128, tiles=4, num_warps=4, reg_prefetch=True, query_fp8=True),
        ),
    ],
}


def key_pool(keys, num_pages: int) -> torch.Tensor:
    """A random index-key pool of `num_pages` pages in the service's layout for format `keys`."""
    from kernels.reference import page_views

    pool = torch.randint(0, 120, (num_pages, P, keys.key_bytes), dtype=torch.uint8, device="cuda")
    if keys.scale_bytes == 0:
        pool.view(torch.bfloat16).copy_(torch.randn(num_pages, P, 128, device="cuda") * 0.1)
    else:
        page_views(pool, keys)[1].view(torch.float32).fill_(0.05)  # page-blocked scales
    return pool


def indexer_case(ceil: dict, reps: int) -> list[Row]:
    from kernels.formats import INDEX_FORMATS
    from kernels.select.indexer import indexer_scores

    rows = []
    pages = C // P
    for fmt, keys in INDEX_FORMATS.items():
        ib = keys.key_bytes
        pool = key_pool(keys, BS * pages)
        q = torch.randn((BS, 64, 128), device="cuda", dtype=torch.bfloat16)
        w = torch.randn((BS, 64), device="cuda", dtype=torch.float32)
        pt = torch.arange(BS * pages, dtype=torch.int32, device="cuda").view(BS, pages)
        req = torch.arange(BS, dtype=torch.int32, device="cuda")
        sl = torch.full((BS,), C, dtype=torch.int32, device="cuda")
        scores = torch.empty((BS, C), device="cuda", dtype=torch.float32)
        call = (q, w, pool, pt, req, sl, scores)
        fns = {
            label: (lambda kw=kw: indexer_scores(*call, index_format=keys, **kw))  # noqa: F821
            for label, kw in INDEXER_VARIANTS[fmt]
        }

        def judge(label: str, us: float):
            gbs, cpu = BS * C * ib / us / 1e3, cpu_call_us(fns[label])
            return gbs / ceil["d2d_gbs"], (
                f"{gbs:.0f} GB/s of keys vs HBM {ceil['d2d_gbs']:.0f}; "
                f"target >=0.60; cpu/call {cpu:.1f}us"
            )

        rows += sweep("indexer", f"bs64 32K ctx {fmt} keys", fns, reps, judge)
        # Free memory now; pyflakes reads the lambdas' names as undefined after this (F821).
        del pool, call
    return rows


def shared_inputs(keys, shared: int) -> tuple:
    """(q, w, pool, page table, request slots, lengths) of BS requests at context C whose first
    `shared` pages are one set of pages."""
    pages = C // P
    pt = torch.arange(BS * pages, dtype=torch.int32, device="cuda").view(BS, pages)
    pt[:, :shared] = pt[0, :shared]
    q = torch.randn((BS, 64, 128), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((BS, 64), device="cuda", dtype=torch.float32)
    req = torch.arange(BS, dtype=torch.int32, device="cuda")
    sl = torch.full((BS,), C, dtype=torch.int32, device="cuda")
    return q, w, key_pool(keys, BS * pages), pt, req, sl


def shared_indexer_case(ceil: dict, reps: int) -> list[Row]:
    """The indexer over rows whose first 24K tokens name the same key pages (a shared prefix
    in the index pool), each format's default launch against the batch-row-major one: the
    shared keys cross HBM once if rows of one chunk run together (from L2 after the first)."""
    from functools import partial

    from kernels.formats import INDEX_FORMATS
    from kernels.select.indexer import indexer_scores

    rows, shared = [], 24576 // P
    for fmt, keys in INDEX_FORMATS.items():
        call = shared_inputs(keys, shared)
        outs = {o: torch.empty((BS, C), device="cuda") for o in ("chunks", "rows")}
        label, base = INDEXER_VARIANTS[fmt][0]
        fns = {
            f"{label}, {o} first": partial(
                indexer_scores, *call, outs[o], index_format=keys, rows_first=o == "rows", **base
            )
            for o in outs
        }
        distinct = (BS * (C // P - shared) + shared) * P * keys.key_bytes

        def judge(label: str, us: float):
            same = torch.equal(outs["chunks"], outs["rows"])
            gbs = distinct / us / 1e3
            return gbs / ceil["d2d_gbs"], (
                f"{gbs:.0f} GB/s of distinct keys vs HBM {ceil['d2d_gbs']:.0f}; bits equal: {same}"
            )

        rows += sweep("indexer", f"bs64 32K ctx {fmt} keys, 24K shared", fns, reps, judge)
    return rows


# (label, TopkWorkspace keywords or None, topk_select keywords); the first is the old default.
TOPK_VARIANTS = [
    ("single r6 w16", None, dict(radix_bits=6, num_warps=16)),
    ("seg4096 r8 w8", dict(segment=4096, radix_bits=8), dict(num_warps=8)),
    ("seg2048 r8 w4", dict(segment=2048, radix_bits=8), dict(num_warps=4, rows=16)),
    ("seg8192 r8 w16", dict(segment=8192, radix_bits=8), dict(num_warps=16)),
    ("seg4096 r6 w8", dict(segment=4096, radix_bits=6), dict(num_warps=8)),
    ("seg4096 r11 w8", dict(segment=4096, radix_bits=11), dict(num_warps=8)),
]


def topk_case(ceil: dict, reps: int) -> list[Row]:
    from kernels.select.indexer import topk_select
    from kernels.select.topk import TopkWorkspace

    scores = torch.randn((BS, C), device="cuda", dtype=torch.float32)
    sl = torch.full((BS,), C, dtype=torch.int32, device="cuda")
    outs = {
        label: torch.empty((BS, K), device="cuda", dtype=torch.int32)
        for label, _, _ in TOPK_VARIANTS
    }
    vals = torch.empty((BS, K), device="cuda", dtype=torch.float32)
    idx = torch.empty((BS, K), device="cuda", dtype=torch.int64)
    fns = {}
    for label, ws_kw, kw in TOPK_VARIANTS:
        ws = None if ws_kw is None else TopkWorkspace.allocate(BS, C, device="cuda", **ws_kw)
        fns[label] = lambda o=outs[label], ws=ws, kw=kw: topk_select(  # noqa: E731
            scores, sl, o, workspace=ws, **kw
        )
    ref = graph_time_us(lambda: torch.topk(scores, K, dim=1, out=(vals, idx)), reps, inner=5)
    first = outs[TOPK_VARIANTS[0][0]]

    def judge(label: str, us: float):
        same, cpu = torch.equal(outs[label], first), cpu_call_us(fns[label])
        return us / ref, (
            f"torch.topk {ref:.1f}us same run; target <=50us; equal to "
            f"{TOPK_VARIANTS[0][0]}: {same}; cpu/call {cpu:.1f}us"
        )

    return sweep("topk_select", "bs64 32K k2048", fns, reps, judge)


ALL = [indexer_case, shared_indexer_case, topk_case]
