"""topk_select must equal ref_topk_select exactly, including ties, -inf, NaN and padding."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (sets TRITON_INTERPRET without CUDA)
from kernels.reference import ref_topk_select
from kernels.select.topk import TopkWorkspace, topk_select


def make_scores(kind, bs, cols, g):
    if kind == "normal":
        return torch.randn(bs, cols, generator=g)
    if kind == "ties":  # few distinct values: ties decide most of the output
        return torch.randint(0, 4, (bs, cols), generator=g).float() - 1.0
    x = torch.randn(bs, cols, generator=g)  # "special": NaN, +-inf, -0.0 and +0.0 mixed in
    pick = torch.rand(bs, cols, generator=g)
    x[pick < 0.1] = float("-inf")
    x[(pick >= 0.1) & (pick < 0.15)] = float("nan")
    x[(pick >= 0.15) & (pick < 0.2)] = -0.0
    x[(pick >= 0.2) & (pick < 0.25)] = 0.0
    x[(pick >= 0.25) & (pick < 0.26)] = float("inf")
    return x


def check(scores, seq_lens, k, **kw):
    out = torch.full((scores.shape[0], k), 12345, dtype=torch.int32, device=scores.device)
    topk_select(scores, seq_lens, out, **kw)
    ref = torch.empty_like(out)
    ref_topk_select(scores, seq_lens, ref)
    assert torch.equal(out, ref)
    return out


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("bs,cols,k", [(1, 700, 64), (3, 1030, 300), (17, 333, 100)])
def test_matches_reference(kind, bs, cols, k, device):
    g = torch.Generator().manual_seed(bs * 31 + cols + len(kind))
    scores = make_scores(kind, bs, cols, g).to(device)
    seq_lens = torch.randint(0, cols + 1, (bs,), generator=g)
    seq_lens[0] = cols  # a full row
    if bs > 2:
        seq_lens[1] = 0  # a padding row
        seq_lens[2] = cols + 50  # clamped to the row width
    check(scores, seq_lens.to(device, torch.int32), k, rows=16, width=32)


@pytest.mark.parametrize("radix_bits", [1, 5, 8, 11])
def test_radix_widths_agree(radix_bits, device):
    g = torch.Generator().manual_seed(radix_bits)
    scores = make_scores("special", 2, 1500, g).to(device)
    seq_lens = torch.tensor([1500, 1201], dtype=torch.int32, device=device)
    check(scores, seq_lens, 257, radix_bits=radix_bits, rows=16, width=64)


def test_k_at_least_seq_len_lists_every_position_then_minus_one(device):
    scores = torch.randn(2, 50, device=device)
    out = check(scores, torch.tensor([30, 50], dtype=torch.int32, device=device), 64)
    assert out[0].tolist() == list(range(30)) + [-1] * 34
    assert out[1].tolist() == list(range(50)) + [-1] * 14


def test_ties_go_to_the_lowest_positions(device):
    scores = torch.zeros(1, 40, device=device)
    scores[0, 35] = 1.0
    out = check(scores, torch.tensor([40], dtype=torch.int32, device=device), 5)
    assert out[0].tolist() == [0, 1, 2, 3, 35]


def test_reference_matches_a_plain_sort():
    g = torch.Generator().manual_seed(0)
    scores = make_scores("special", 4, 90, g)
    seq_lens = torch.tensor([90, 40, 7, 0], dtype=torch.int32)
    ref = torch.empty(4, 20, dtype=torch.int32)
    ref_topk_select(scores, seq_lens, ref)
    for b in range(4):
        n = int(seq_lens[b])
        vals = [(-1e39 if v != v else (0.0 if v == 0 else v)) for v in scores[b, :n].tolist()]
        best = sorted(sorted(range(n), key=lambda t: (-vals[t], t))[:20])
        assert ref[b].tolist() == best + [-1] * (20 - len(best))


def random_rows(kind, bs, cols, seed, device):
    g = torch.Generator().manual_seed(seed)
    scores = make_scores(kind, bs, cols, g).to(device)
    seq_lens = torch.randint(0, cols + 1, (bs,), generator=g)
    seq_lens[0], seq_lens[1], seq_lens[2] = cols, 0, cols + 50  # full, padding, clamped
    return scores, seq_lens.to(device, torch.int32)


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
def test_segmented_matches_reference_and_reuses_its_workspace(kind, device):
    scores, seq_lens = random_rows(kind, 4, 1030, len(kind), device)
    ws = TopkWorkspace.allocate(6, 1100, segment=256, radix_bits=8, device=device)
    first = check(scores, seq_lens, 300, workspace=ws, rows=16, width=32, block=64)
    assert not ws.arrive.any()  # counters are back to zero
    again = check(scores, seq_lens, 300, workspace=ws, rows=16, width=32, block=128)
    assert torch.equal(first, again)


@pytest.mark.parametrize("radix_bits,segment", [(5, 512), (11, 128)])
def test_segmented_radix_widths_agree(radix_bits, segment, device):
    scores, seq_lens = random_rows("special", 3, 1500, radix_bits, device)
    ws = TopkWorkspace.allocate(3, 1500, segment=segment, radix_bits=radix_bits, device=device)
    check(scores, seq_lens, 257, workspace=ws, rows=16, width=64, block=256)


def test_segmented_short_rows_and_ties(device):
    scores = torch.zeros(3, 40, device=device)
    scores[0, 35] = 1.0
    seq_lens = torch.tensor([40, 30, 12], dtype=torch.int32, device=device)
    ws = TopkWorkspace.allocate(3, 40, segment=16, device=device)
    out = check(scores, seq_lens, 14, workspace=ws, rows=16, width=16, block=16)
    assert out[0].tolist() == list(range(13)) + [35]
    assert out[2].tolist() == list(range(12)) + [-1, -1]


def test_segmented_workspace_must_fit(device):
    scores = torch.randn(2, 100, device=device)
    out = torch.empty(2, 8, dtype=torch.int32, device=device)
    lens = torch.full((2,), 100, dtype=torch.int32, device=device)
    for ws in (
        TopkWorkspace.allocate(1, 100, segment=16, device=device),
        TopkWorkspace.allocate(2, 50, segment=16, device=device),
    ):
        with pytest.raises(ValueError):
            topk_select(scores, lens, out, workspace=ws)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("segmented", [False, True])
def test_gpu_deepseek_shapes(kind, segmented):
    g = torch.Generator().manual_seed(len(kind))
    scores = make_scores(kind, 64, 32768, g).cuda()
    seq_lens = torch.randint(1, 32769, (64,), generator=g)
    seq_lens[:8] = 32768
    seq_lens[8] = 2048
    seq_lens[9] = 100
    seq_lens = seq_lens.to("cuda", torch.int32)
    kw = {"workspace": TopkWorkspace.allocate(64, 32768, device="cuda")} if segmented else {}
    out = check(scores, seq_lens, 2048, **kw)
    again = torch.empty_like(out)
    topk_select(scores, seq_lens, again, **kw)
    assert torch.equal(out, again)
