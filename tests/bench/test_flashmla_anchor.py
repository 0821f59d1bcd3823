"""bench/kernels/flashmla_anchor.py maps our attention's arguments onto FlashMLA's: each index is
the slot's absolute row, padding is exactly -1, and a page view finds the same bytes."""

from __future__ import annotations

import pytest
import torch

from bench.kernels import flashmla_anchor
from bench.kernels.flashmla_anchor import PAGE, inputs


def _args(bs: int = 3, heads: int = 4, k: int = 5, rows_each: int = PAGE):
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (bs * rows_each, 656), generator=g, dtype=torch.uint8)
    q_nope = torch.randn(bs, heads, 512, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(bs, heads, 64, generator=g).to(torch.bfloat16)
    row_base = torch.arange(bs, dtype=torch.int64) * rows_each
    slots = torch.randint(0, rows_each, (bs, k), generator=g, dtype=torch.int32)
    slots[1, 2] = -1
    slots[2, :] = -1
    return q_nope, q_pe, kv, row_base, slots


def test_indices_are_absolute_rows_and_padding_is_minus_one() -> None:
    q_nope, q_pe, kv, row_base, slots = _args()
    q, pages, indices = inputs(q_nope, q_pe, kv, row_base, slots)
    assert indices.shape == (3, 1, 5) and indices.dtype == torch.int32
    for b in range(3):
        for i in range(5):
            s = int(slots[b, i])
            want = -1 if s < 0 else int(row_base[b]) + s
            assert int(indices[b, 0, i]) == want
            if want >= 0:  # the page view holds that row's bytes where FlashMLA looks
                assert torch.equal(pages[want // PAGE, want % PAGE, 0], kv[want])
    assert pages.data_ptr() == kv.data_ptr()  # a view: nothing copied
    assert torch.equal(q[:, 0, :, :512], q_nope) and torch.equal(q[:, 0, :, 512:], q_pe)


def test_rows_that_do_not_fill_pages_or_are_not_fp8_are_refused() -> None:
    q_nope, q_pe, kv, row_base, slots = _args()
    with pytest.raises(ValueError, match="multiple"):
        inputs(q_nope, q_pe, kv[:-1], row_base, slots)
    with pytest.raises(ValueError, match="uint8"):
        inputs(q_nope, q_pe, kv.to(torch.int16), row_base, slots)
    with pytest.raises(ValueError, match="row_base"):
        inputs(q_nope, q_pe, kv, row_base[:2], slots)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_the_anchor_says_why() -> None:
    assert flashmla_anchor.available() == "needs CUDA"
