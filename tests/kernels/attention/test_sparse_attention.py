"""sparse_mla_decode against its fp64 reference, dense attention, and across KV layouts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kernels  # noqa: F401  (sets TRITON_INTERPRET without CUDA)
from kernels.attention.configs import TABLE
from kernels.attention.sparse import (
    AttnWorkspace,
    LaunchConfig,
    TileWorkspace,
    decode_num_splits,
    sparse_mla_decode,
)
from kernels.formats import BF16_ROW, FP8_ROW, ROW_FORMATS, RowFormat
from kernels.reference import ref_sparse_mla_decode

D_V, D_PE = 512, 64


def make_inputs(bs, heads, k, rows_per_req, device, seed, pad_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(bs, heads, D_V, generator=g).to(device, torch.bfloat16)
    q_pe = torch.randn(bs, heads, D_PE, generator=g).to(device, torch.bfloat16)
    kv = torch.randn(bs * rows_per_req, D_V + D_PE, generator=g).to(device, torch.bfloat16)
    row_base = (torch.arange(bs) * rows_per_req).to(device, torch.int64)
    slots = torch.stack([torch.randperm(rows_per_req, generator=g)[:k] for _ in range(bs)])
    slots[torch.rand(bs, k, generator=g) < pad_frac] = -1
    return q_nope, q_pe, kv, row_base, slots.to(device, torch.int32)


def run_kernel(q_nope, q_pe, kv, row_base, slots, scale, **kw):
    bs, heads, _ = q_nope.shape
    out = torch.full((bs, heads, D_V), float("nan"), dtype=torch.bfloat16, device=q_nope.device)
    lse = torch.full((bs, heads), float("nan"), dtype=torch.float32, device=q_nope.device)
    sparse_mla_decode(q_nope, q_pe, kv, row_base, slots, scale, out, lse, **kw)
    return out, lse


def run_reference(q_nope, q_pe, kv, row_base, slots, scale, **kw):
    bs, heads, _ = q_nope.shape
    out = torch.empty(bs, heads, D_V, dtype=torch.float64, device=q_nope.device)
    lse = torch.empty(bs, heads, dtype=torch.float64, device=q_nope.device)
    ref_sparse_mla_decode(q_nope, q_pe, kv, row_base, slots, scale, out, lse, **kw)
    return out, lse


def assert_close_to_reference(out, lse, ref_out, ref_lse):
    has_any = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), has_any)
    assert (out[~has_any] == 0).all()
    assert (lse[~has_any] == float("-inf")).all()
    if has_any.any():
        err = (out.double() - ref_out)[has_any].norm(dim=-1)
        assert (err / ref_out[has_any].norm(dim=-1)).max() < 1e-2
        assert (lse.double() - ref_lse)[has_any].abs().max() < 1e-3


@pytest.mark.parametrize("bs,heads,k,rows", [(1, 4, 37, 60), (3, 8, 150, 400), (17, 4, 64, 80)])
def test_matches_reference(bs, heads, k, rows, device):
    args = make_inputs(bs, heads, k, rows, device, seed=bs * 1000 + k)
    args[-1][-1, :] = -1  # one row with no valid slot
    scale = 1.0 / math.sqrt(D_V + D_PE)
    out, lse = run_kernel(*args, scale)
    assert_close_to_reference(out, lse, *run_reference(*args, scale))


def test_every_token_selected_equals_dense_attention(device):
    bs, heads, n = 2, 8, 96
    q_nope, q_pe, kv, row_base, _ = make_inputs(bs, heads, n, n, device, seed=7, pad_frac=0)
    slots = torch.arange(n, dtype=torch.int32, device=device).repeat(bs, 1)
    scale = 0.05
    out, lse = run_kernel(q_nope, q_pe, kv, row_base, slots, scale, block_n=32)
    keys = kv.float().view(bs, n, D_V + D_PE)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    scores = scale * q @ keys.transpose(1, 2)  # [bs, H, n]
    dense = torch.softmax(scores, dim=-1) @ keys[..., :D_V]
    rel = (out.float() - dense).norm(dim=-1) / dense.norm(dim=-1)
    assert rel.max() < 1e-2
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-3)


@pytest.mark.parametrize(
    "splits,dtype",
    [(2, torch.float32), (3, torch.float32), (4, torch.bfloat16), (8, torch.float32)],
)
def test_split_k_matches_reference(splits, dtype, device):
    args = make_inputs(3, 8, 150, 400, device, seed=splits)
    args[-1][-1, :] = -1  # one row with no valid slot
    args[-1][0, :100] = -1  # row 0: its first splits are empty
    ws = AttnWorkspace.allocate(5, 8, splits, dtype=dtype, device=device)
    scale = 1.0 / math.sqrt(D_V + D_PE)
    out, lse = run_kernel(*args, scale, workspace=ws, block_n=16, slot_stage=32)
    assert_close_to_reference(out, lse, *run_reference(*args, scale))


def test_split_count_depends_on_k_only():
    assert [decode_num_splits(k) for k in (8, 1023, 1024, 2048, 4096, 100000)] == [1, 1, 1, 2, 4, 8]


def test_workspace_must_fit(device):
    args = make_inputs(3, 8, 20, 40, device, seed=2)
    for ws in (
        AttnWorkspace.allocate(2, 8, 2, device=device),
        AttnWorkspace.allocate(3, 4, 2, device=device),
    ):
        with pytest.raises(ValueError):
            run_kernel(*args, 0.1, workspace=ws)


@pytest.mark.parametrize("splits", [1, 3])
def test_layouts_that_gather_the_same_rows_give_identical_bits(splits, device):
    bs, heads, k, rows = 3, 8, 70, 100
    q_nope, q_pe, kv, row_base, slots = make_inputs(bs, heads, k, rows, device, seed=11)
    # Layout B: every row moved elsewhere in a larger buffer, slots remapped relative to new bases.
    perm = (
        torch.randperm(bs * rows + 50, generator=torch.Generator().manual_seed(3)).to(device) + 17
    )
    kv_b = torch.randn(bs * rows + 67, D_V + D_PE, device=device).to(torch.bfloat16)
    kv_b[perm[: bs * rows]] = kv
    base_b = torch.tensor([5, 0, 17], dtype=torch.int64, device=device)
    rows_a = row_base[:, None] + slots.long()
    slots_b = torch.where(slots >= 0, perm[rows_a.clamp(min=0)] - base_b[:, None], -1).to(
        torch.int32
    )
    ws = AttnWorkspace.allocate(bs, heads, splits, device=device)
    out_a, lse_a = run_kernel(q_nope, q_pe, kv, row_base, slots, 0.04, workspace=ws, block_n=16)
    out_b, lse_b = run_kernel(q_nope, q_pe, kv_b, base_b, slots_b, 0.04, workspace=ws, block_n=16)
    assert torch.equal(out_a, out_b)
    assert torch.equal(lse_a, lse_b)


def test_padding_slots_are_never_read(device):
    bs, heads, k, rows = 3, 4, 40, 50
    q_nope, q_pe, kv, _, slots = make_inputs(bs, heads, k, rows, device, seed=5)
    # Put a NaN row right before each request's rows: slot -1 addresses it, and any use of it
    # would turn the output into NaN.
    nan_row = torch.full_like(kv[:1], float("nan"))
    kv = torch.cat([t for b in range(bs) for t in (nan_row, kv[b * rows : (b + 1) * rows])])
    row_base = (torch.arange(bs, device=device) * (rows + 1) + 1).to(torch.int64)
    out, lse = run_kernel(q_nope, q_pe, kv, row_base, slots, 0.1)
    assert_close_to_reference(out, lse, *run_reference(q_nope, q_pe, kv, row_base, slots, 0.1))


def test_rejects_bad_shapes(device):
    q_nope, q_pe, kv, row_base, slots = make_inputs(2, 4, 8, 16, device, seed=1)
    out = torch.empty(2, 4, D_V, dtype=torch.bfloat16, device=device)
    lse = torch.empty(2, 4, device=device)
    with pytest.raises(ValueError):
        sparse_mla_decode(q_nope, q_pe, kv.float(), row_base, slots, 1.0, out, lse)
    with pytest.raises(ValueError):
        sparse_mla_decode(q_nope, q_pe, kv, row_base.int(), slots, 1.0, out, lse)
    with pytest.raises(ValueError):
        sparse_mla_decode(q_nope, q_pe, kv, row_base, slots, 1.0, out[:, :2], lse)
    with pytest.raises(ValueError, match="mix_maxnreg"):
        LaunchConfig(mix_maxnreg=256)


# Two-pass launches that move work between programs differently (small heads/chunk/columns
# blocks exercise the grid's head and column axes and several chunks per row).
LAUNCHES = [
    None,
    LaunchConfig(score_heads=16, chunk=32, mix_cols=64, score_stages=1, mix_stages=1),
    LaunchConfig(score_heads=16, chunk=64, mix_cols=256, mix_warps=4),
    LaunchConfig(chunk=64, mix_cols=128, mix_warps=4, mix_heads=16),
    LaunchConfig(score_heads=16, chunk=128, mix_cols=128, score_prefetch=True),
    LaunchConfig(chunk=128, mix_cols=64, mix_flat=True, mix_maxnreg=232),
]
# On GPU, the knobs the launch table varies for 128 heads (all heads per score program: the
# tensor cores' instruction stays the same; a 16-head tile would use another one), and the mix
# pass at 64 heads.
GPU_LAUNCHES = [
    None,
    LaunchConfig(chunk=256, mix_cols=128, mix_warps=4),
    LaunchConfig(chunk=1024, mix_cols=64, mix_warps=4, mix_stages=4),
    LaunchConfig(chunk=2048, mix_stages=2),
    # The mix pass at 64 heads a program (one warpgroup's M; bench.kernels.attention_sass: no
    # spills where 128 heads spill), which the table may pick only if its bits are the same.
    LaunchConfig(chunk=256, mix_cols=128, mix_warps=4, mix_stages=2, mix_heads=64),
    LaunchConfig(chunk=512, mix_cols=64, mix_warps=4, mix_stages=4, mix_heads=64),
    # The score pass's register prefetch of the next tile (a flat loop over the chunk's tiles).
    LaunchConfig(chunk=256, score_prefetch=True),
    LaunchConfig(chunk=2048, mix_stages=2, score_prefetch=True),
    # The mix pass as one flat loop, each tile's slots loaded where used.
    LaunchConfig(chunk=256, mix_flat=True),
    LaunchConfig(chunk=256, mix_cols=128, mix_warps=4, mix_flat=True),
    # A register cap (room for a miss-copy CTA beside the pass): ptxas spills, no sum moves.
    LaunchConfig(chunk=256, mix_flat=True, mix_maxnreg=232),
    LaunchConfig(chunk=256, mix_maxnreg=224),
]


def run_two_pass(args, scale, launch=None, row_format: RowFormat = BF16_ROW, ws=None):
    bs, heads, k = args[0].shape[0], args[0].shape[1], args[-1].shape[1]
    ws = ws or TileWorkspace.allocate(
        bs + 2, heads, k, row_format=row_format, device=args[0].device
    )
    return run_kernel(*args, scale, workspace=ws, launch=launch, row_format=row_format)


@pytest.mark.parametrize(
    "bs,heads,k,rows,launch",
    [(1, 4, 37, 60, LAUNCHES[1]), (3, 8, 150, 400, None), (5, 20, 64, 80, LAUNCHES[1])],
)
def test_two_pass_matches_reference(bs, heads, k, rows, launch, device):
    args = make_inputs(bs, heads, k, rows, device, seed=bs * 1000 + k)
    args[-1][-1, :] = -1  # one row with no valid slot
    args[-1][0, :40] = -1  # row 0: its first tiles are empty
    scale = 1.0 / math.sqrt(D_V + D_PE)
    out, lse = run_two_pass(args, scale, launch)
    assert_close_to_reference(out, lse, *run_reference(*args, scale))


def test_two_pass_bits_do_not_depend_on_the_launch(device):
    """The table may pick any launch per batch size: chunks, head and column blocks, warps and
    stages move work between programs but never change a sum."""
    args = make_inputs(2, 20, 70, 90, device, seed=9)
    launches = GPU_LAUNCHES if args[0].is_cuda else LAUNCHES
    outs = [run_two_pass(args, 0.05, launch) for launch in launches]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_every_table_launch_gives_the_same_bits(device):
    """Each configuration the launch table picks by batch (kernels/attention/configs.py) is one
    more launch of the same tiles: equal bits, whichever bucket a batch falls in."""
    args = make_inputs(1, 20, 70, 90, device, seed=11)
    table = {cfg for rows in TABLE.values() for _, cfg in rows}
    outs = [run_two_pass(args, 0.05, launch) for launch in [None, *sorted(table, key=repr)]]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_tile_workspace_must_fit(device):
    args = make_inputs(3, 8, 70, 90, device, seed=2)
    for ws in (
        TileWorkspace.allocate(2, 8, 70, device=device),
        TileWorkspace.allocate(3, 4, 70, device=device),
        TileWorkspace.allocate(3, 8, 20, device=device),
    ):
        with pytest.raises(ValueError, match="tile workspace"):
            run_kernel(*args, 0.1, workspace=ws)
    # A row format without a Triton variant (reference kernels only) has no tile size.
    no_kernel = dataclasses.replace(BF16_ROW, name="bf16-ref", kernel=None)
    with pytest.raises(ValueError, match="tile workspace"):
        TileWorkspace.allocate(3, 8, 70, row_format=no_kernel)


GPU_CONFIGS = [
    dict(),
    dict(block_n=64, num_stages=2),
    dict(block_n=32, num_stages=4),
    dict(splits=2),
    dict(splits=4, dtype=torch.bfloat16, block_n=64, num_stages=2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bs,pad_frac", [(4, 0.0), (9, 0.3)])
@pytest.mark.parametrize("cfg", GPU_CONFIGS)
def test_gpu_deepseek_shapes(bs, pad_frac, cfg):
    cfg = dict(cfg)
    splits, dtype = cfg.pop("splits", 1), cfg.pop("dtype", torch.float32)
    ws = AttnWorkspace.allocate(bs, 128, splits, dtype=dtype, device="cuda")
    args = make_inputs(bs, 128, 2048, 4096, "cuda", seed=bs, pad_frac=pad_frac)
    scale = 1.0 / math.sqrt(D_V + D_PE)
    out, lse = run_kernel(*args, scale, workspace=ws, **cfg)
    assert_close_to_reference(out, lse, *run_reference(*args, scale))
    out2, lse2 = run_kernel(*args, scale, workspace=ws, **cfg)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_layouts_give_identical_bits(splits):
    test_layouts_that_gather_the_same_rows_give_identical_bits(splits, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("bs,pad_frac", [(4, 0.0), (9, 0.3), (30, 0.2), (70, 0.1)])
def test_gpu_two_pass_deepseek_shapes(bs, pad_frac):
    """The table's launches (bs 4, 9, 30, 70 fall in different buckets) and the other test launches
    against the reference, with the same bits for every launch and on a second call."""
    args = make_inputs(bs, 128, 2048, 4096, "cuda", seed=bs, pad_frac=pad_frac)
    scale = 1.0 / math.sqrt(D_V + D_PE)
    out, lse = run_two_pass(args, scale)
    assert_close_to_reference(out, lse, *run_reference(*args, scale))
    for launch in GPU_LAUNCHES:
        out2, lse2 = run_two_pass(args, scale, launch)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), launch


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_gpu_two_pass_launches_give_identical_bits(row_format):
    from kernels.store.fp8_row import kv_quantize

    q_nope, q_pe, kv, row_base, slots = make_inputs(5, 128, 700, 900, "cuda", seed=3)
    fmt = ROW_FORMATS[row_format]
    if fmt is FP8_ROW:
        kv8 = torch.empty(kv.shape[0], fmt.row_bytes, dtype=torch.uint8, device="cuda")
        kv_quantize(kv, kv8)
        kv = kv8
    args = (q_nope, q_pe, kv, row_base, slots)
    ws = TileWorkspace.allocate(5, 128, 700, row_format=fmt, device="cuda")
    outs = [run_two_pass(args, 0.05, launch, fmt, ws=ws) for launch in GPU_LAUNCHES]
    for (out, lse), launch in zip(outs[1:], GPU_LAUNCHES[1:]):
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1]), launch
