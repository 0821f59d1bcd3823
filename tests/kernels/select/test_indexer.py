"""indexer_scores against its fp64 reference, for bf16 and fp8 index keys."""

from __future__ import annotations

import pytest
import torch

from kernels.formats import FP8_KEYS, INDEX_FORMATS
from kernels.reference import read_index_rows, ref_indexer_scores
from kernels.reference.select import fp8_query_values
from kernels.select.indexer import indexer_scores

HEADS, DIM = 64, 128


def make_pool(fmt, num_pages, page, g):
    """An index-key pool of one layer in the service's byte layout; fp8 pages are page-blocked:
    the page's P x 128 fp8 values, then its P fp32 scales."""
    keys = torch.randn(num_pages, page, DIM, generator=g)
    if fmt == "bf16":
        return keys.to(torch.bfloat16).view(torch.uint8)
    values = keys.to(torch.float8_e4m3fn).view(torch.uint8).view(num_pages, page * DIM)
    scales = (torch.rand(num_pages, page, generator=g) + 0.05).view(torch.uint8)
    return torch.cat([values, scales], dim=1).view(num_pages, page, DIM + 4)


def make_inputs(fmt, bs, page, seq_lens, cols, device, seed, requests=None):
    g = torch.Generator().manual_seed(seed)
    requests = requests or bs + 2
    max_pages = -(-max(max(seq_lens), cols) // page)
    pages = torch.randperm(requests * max_pages + 3, generator=g)[: requests * max_pages]
    page_table = pages.view(requests, max_pages).to(torch.int32)
    req_slots = torch.randperm(requests, generator=g)[:bs].to(torch.int32)
    req_slots[bs // 2] = -1 if bs > 1 else req_slots[0]  # a padding row
    return dict(
        q=torch.randn(bs, HEADS, DIM, generator=g).to(torch.bfloat16).to(device),
        w=torch.randn(bs, HEADS, generator=g).to(device),
        index_pool_layer=make_pool(fmt, requests * max_pages + 3, page, g).to(device),
        page_table=page_table.to(device),
        req_slots=req_slots.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        index_format=INDEX_FORMATS[fmt],
    )


def check(inputs, cols, **kw):
    bs = inputs["q"].shape[0]
    out = torch.full((bs, cols), float("nan"), device=inputs["q"].device)
    indexer_scores(**inputs, out_scores=out, **kw)
    ref = torch.empty_like(out)
    ref_indexer_scores(**inputs, out_scores=ref, query_fp8=kw.get("query_fp8", False))
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    assert (out[~finite] == float("-inf")).all()
    scale = ref[finite].abs().max() if finite.any() else 1.0
    torch.testing.assert_close(
        out[finite], ref[finite], rtol=1e-5, atol=_tolerance(out, kw) * float(scale)
    )
    return out


def _tolerance(out, kw):
    """Of the largest score. Hopper's fp8 tensor-core MMA keeps ~14 bits of its fp32 running
    sum (DeepSeek-V3's report, on FP8 GEMM accumulation), so e4m3 x e4m3 dot products on a GPU
    miss the fp64 reference by ~2^-12 of the scores' scale (run AE: 1.8e-4 at most, 43% of the
    scores past 1e-5): the e4m3 query is held to 2^-10 there; every other path to 1e-5."""
    return 2.0**-10 if kw.get("query_fp8") and out.is_cuda else 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "bs,page,seq_lens,cols",
    [
        (1, 16, [77], 100),
        (3, 7, [130, 5, 64], 150),
        (17, 16, [i * 23 + 1 for i in range(17)], 300),
    ],
)
def test_matches_reference(fmt, bs, page, seq_lens, cols, device):
    check(make_inputs(fmt, bs, page, seq_lens, cols, device, seed=bs * 7 + page), cols)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_rows_first_launch_keeps_every_bit(fmt, device):
    """The batch-row-major launch (for rows that share key pages) computes what the default one
    does: rows with a common prefix of pages, one a padding row, irregular lengths."""
    seq_lens = [150, 150, 97, 13, 150]
    inputs = make_inputs(fmt, 5, 7, seq_lens, 160, device, seed=11)
    slots, table = inputs["req_slots"].tolist(), inputs["page_table"]
    for r in (slots[1], slots[4]):  # rows 1 and 4 share row 0's first 15 pages (105 tokens)
        table[r, :15] = table[slots[0], :15]
    kw = dict(block_t=32, tiles=2)
    out = check(inputs, 160, **kw)
    again = torch.full_like(out, float("nan"))
    indexer_scores(**inputs, out_scores=again, rows_first=True, **kw)
    assert torch.equal(again, out)


def test_seq_len_beyond_output_width_is_clamped(device):
    inputs = make_inputs("bf16", 2, 16, [200, 40], 96, device, seed=3)
    check(inputs, 96, block_t=32, tiles=2)


def test_missing_page_scores_minus_inf(device):
    inputs = make_inputs("fp8", 2, 8, [60, 60], 64, device, seed=4)
    r = int(inputs["req_slots"][0])
    inputs["page_table"][r, 2] = -1  # tokens 16..23 of row 0 have no page
    out = check(inputs, 64)
    assert (out[0, 16:24] == float("-inf")).all() and torch.isfinite(out[0, :16]).all()


def test_tokens_beyond_the_page_table_score_minus_inf(device):
    inputs = make_inputs("bf16", 2, 8, [60, 30], 64, device, seed=6)
    inputs["page_table"] = inputs["page_table"][:, :5].contiguous()  # reaches 40 tokens
    out = check(inputs, 64)
    assert (out[0, 40:] == float("-inf")).all() and torch.isfinite(out[0, :40]).all()


def test_fp8_queries_of_any_magnitude(device):
    """fp8 keys are scored with an f16 copy of q scaled by a power of two: exact for q far
    outside f16's range, and q = 0 gives 0, not 0 * inf."""
    inputs = make_inputs("fp8", 4, 16, [77, 30, 5, 60], 100, device, seed=9)  # row 2: padding
    inputs["q"][0] = 0
    inputs["q"][1] *= 1e5
    inputs["q"][3] *= 1e-7
    out = check(inputs, 100)
    assert (out[0, :77] == 0).all()


@pytest.mark.parametrize(
    "bs,page,seq_lens,cols",
    [(1, 16, [77], 100), (3, 7, [130, 5, 64], 150), (5, 16, [300, 1, 129, 255, 64], 300)],
)
def test_fp8_query_matches_its_reference(bs, page, seq_lens, cols, device):
    """query_fp8: e4m3 x e4m3 products (exact in fp32), summed in fp32: the fp64 reference over
    the same quantized q within fp32 rounding, for q of any magnitude and a head of zeros."""
    inputs = make_inputs("fp8", bs, page, seq_lens, cols, device, seed=bs * 5 + page)
    inputs["q"][0, 3] = 0
    inputs["q"][-1] *= 1e6
    check(inputs, cols, block_t=32, tiles=2, query_fp8=True)


def test_fp8_query_stays_close_to_the_f16_query(device):
    """The e4m3 query rounds each value to 3 mantissa bits: scores move by a few percent of
    their scale, not more (the two paths score the same keys)."""
    inputs = make_inputs("fp8", 3, 16, [200, 64, 130], 200, device, seed=21)
    out8 = check(inputs, 200, query_fp8=True)
    out16 = check(inputs, 200)
    finite = torch.isfinite(out16)
    scale = out16[finite].abs().max()
    assert (out8[finite] - out16[finite]).abs().max() < 0.1 * scale
    assert not torch.equal(out8, out16)


def test_fp8_query_values_scale_to_e4m3s_range():
    """The per-head power of two: max |q| lands in (224, 448], exactly at 448 kept."""
    q = torch.zeros(3, DIM)
    q[0, 0], q[1, 5], q[2, 7] = 448.0 * 2**-10, 448.0 * 2**-10 * 1.001, 3.0
    e4m3 = fp8_query_values(q)
    assert e4m3[0, 0] == q[0, 0] and e4m3[2, 7] == 3.0
    assert abs(float(e4m3[1, 5]) / float(q[1, 5]) - 1) < 2**-3
    assert (fp8_query_values(torch.zeros(2, DIM)) == 0).all()


def test_fp8_query_needs_fp8_keys(device):
    inputs = make_inputs("bf16", 1, 16, [10], 16, device, seed=5)
    with pytest.raises(ValueError, match="fp8"):
        indexer_scores(**inputs, out_scores=torch.empty(1, 16, device=device), query_fp8=True)


def test_explicit_format_must_match_key_bytes(device):
    inputs = make_inputs("bf16", 1, 16, [10], 16, device, seed=5)
    out = torch.empty(1, 16, device=device)
    with pytest.raises(ValueError):
        indexer_scores(**{**inputs, "index_format": FP8_KEYS}, out_scores=out)


def test_fp8_pool_pages_are_value_rows_then_scales():
    pool = make_pool("fp8", 3, 5, torch.Generator().manual_seed(1))
    rows = read_index_rows(pool, torch.tensor([2, 0]), torch.tensor([4, 1]), FP8_KEYS)
    flat = pool.view(3, 5 * (DIM + 4))
    assert torch.equal(rows[0, :DIM], flat[2, 4 * DIM : 5 * DIM])
    assert torch.equal(rows[0, DIM:], flat[2, 5 * DIM + 16 : 5 * DIM + 20])
    assert torch.equal(rows[1, DIM:], flat[0, 5 * DIM + 4 : 5 * DIM + 8])


def test_fp8_keys_decode_to_value_times_scale():
    raw = torch.zeros(1, DIM + 4, dtype=torch.uint8)
    raw[0, :DIM] = torch.full((DIM,), 1.5).to(torch.float8_e4m3fn).view(torch.uint8)
    raw[0, DIM:] = torch.tensor([0.25]).view(torch.uint8)
    assert torch.equal(FP8_KEYS.decode(raw), torch.full((1, DIM), 0.375))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,query_fp8", [("bf16", False), ("fp8", False), ("fp8", True)])
def test_gpu_long_context(fmt, query_fp8):
    seq_lens = [32768, 1, 20000, 32700, 64, 31999, 5000, 32768]
    check(make_inputs(fmt, 8, 64, seq_lens, 32768, "cuda", seed=11), 32768, query_fp8=query_fp8)
