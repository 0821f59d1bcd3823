"""indexer_scores against its fp64 reference, for bf16 and fp8 index keys."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (sets TRITON_INTERPRET without CUDA)
from kernels.indexer import indexer_scores
from kernels.reference import decode_index_keys, ref_indexer_scores

HEADS, DIM = 64, 128


def make_pool(fmt, num_pages, page, g):
    """An index-key pool of one layer in the service's byte layout."""
    keys = torch.randn(num_pages, page, DIM, generator=g)
    if fmt == "bf16":
        return keys.to(torch.bfloat16).view(torch.uint8)
    pool = torch.empty(num_pages, page, DIM + 4, dtype=torch.uint8)
    pool[..., :DIM] = keys.to(torch.float8_e4m3fn).view(torch.uint8)
    pool[..., DIM:] = (torch.rand(num_pages, page, 1, generator=g) + 0.05).view(torch.uint8)
    return pool


def make_inputs(fmt, bs, page, seq_lens, cols, device, seed, requests=None):
    g = torch.Generator().manual_seed(seed)
    requests = requests or bs + 2
    max_pages = -(-max(max(seq_lens), cols) // page)
    pages = torch.randperm(requests * max_pages + 3, generator=g)[: requests * max_pages]
    page_table = pages.view(requests, max_pages).to(torch.int32)
    req_slots = torch.randperm(requests, generator=g)[:bs].to(torch.int32)
    req_slots[bs // 2] = -1 if bs > 1 else req_slots[0]            # a padding row
    return dict(
        q=torch.randn(bs, HEADS, DIM, generator=g).to(torch.bfloat16).to(device),
        w=torch.randn(bs, HEADS, generator=g).to(device),
        index_pool_layer=make_pool(fmt, requests * max_pages + 3, page, g).to(device),
        page_table=page_table.to(device), req_slots=req_slots.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


def check(inputs, cols, **kw):
    bs = inputs["q"].shape[0]
    out = torch.full((bs, cols), float("nan"), device=inputs["q"].device)
    indexer_scores(**inputs, out_scores=out, **kw)
    ref = torch.empty_like(out)
    ref_indexer_scores(**inputs, out_scores=ref)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    assert (out[~finite] == float("-inf")).all()
    scale = ref[finite].abs().max() if finite.any() else 1.0
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-5, atol=1e-5 * float(scale))
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("bs,page,seq_lens,cols", [
    (1, 16, [77], 100),
    (3, 7, [130, 5, 64], 150),
    (17, 16, [i * 23 + 1 for i in range(17)], 300),
])
def test_matches_reference(fmt, bs, page, seq_lens, cols, device):
    check(make_inputs(fmt, bs, page, seq_lens, cols, device, seed=bs * 7 + page), cols)


def test_seq_len_beyond_output_width_is_clamped(device):
    inputs = make_inputs("bf16", 2, 16, [200, 40], 96, device, seed=3)
    check(inputs, 96, block_t=32, tiles=2)


def test_missing_page_scores_minus_inf(device):
    inputs = make_inputs("fp8", 2, 8, [60, 60], 64, device, seed=4)
    r = int(inputs["req_slots"][0])
    inputs["page_table"][r, 2] = -1                    # tokens 16..23 of row 0 have no page
    out = check(inputs, 64)
    assert (out[0, 16:24] == float("-inf")).all() and torch.isfinite(out[0, :16]).all()


def test_tokens_beyond_the_page_table_score_minus_inf(device):
    inputs = make_inputs("bf16", 2, 8, [60, 30], 64, device, seed=6)
    inputs["page_table"] = inputs["page_table"][:, :5].contiguous()     # reaches 40 tokens
    out = check(inputs, 64)
    assert (out[0, 40:] == float("-inf")).all() and torch.isfinite(out[0, :40]).all()


def test_explicit_format_must_match_key_bytes(device):
    inputs = make_inputs("bf16", 1, 16, [10], 16, device, seed=5)
    out = torch.empty(1, 16, device=device)
    with pytest.raises(ValueError):
        indexer_scores(**inputs, out_scores=out, index_format="fp8")


def test_fp8_keys_decode_to_value_times_scale():
    raw = torch.zeros(1, DIM + 4, dtype=torch.uint8)
    raw[0, :DIM] = torch.full((DIM,), 1.5).to(torch.float8_e4m3fn).view(torch.uint8)
    raw[0, DIM:] = torch.tensor([0.25]).view(torch.uint8)
    assert torch.equal(decode_index_keys(raw), torch.full((1, DIM), 0.375))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_long_context(fmt):
    seq_lens = [32768, 1, 20000, 32700, 64, 31999, 5000, 32768]
    check(make_inputs(fmt, 8, 64, seq_lens, 32768, "cuda", seed=11), 32768)
