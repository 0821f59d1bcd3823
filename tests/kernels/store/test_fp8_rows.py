"""fp8 KV rows (DeepSeek-V3.2's 656 B FlashMLA format): the quantize reference against float64,
the kernels against the references (bitwise), attention over fp8 rows, and fp8 appends."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from kernels.attention.sparse import AttnWorkspace, TileWorkspace, sparse_mla_decode
from kernels.formats import (
    FP8_KEYS,
    FP8_ROW,
    FP8_ROW_BYTES,
    fp8_block_scales,
)
from kernels.formats import dequantize_fp8_rows as ref_dequantize_kv_rows
from kernels.formats import quantize_fp8_rows as ref_quantize_kv_rows
from kernels.reference import ref_kv_append
from kernels.store.append import kv_append
from kernels.store.fp8_row import kv_quantize
from tests.kernels.attention.test_sparse_attention import (
    LAUNCHES,
    assert_close_to_reference,
    make_inputs,
    run_kernel,
    run_two_pass,
)
from tests.kernels.attention.test_sparse_attention import run_reference as run_bf16_reference
from tests.kernels.store.test_kv_append import L, R, Tiers, W, control, random_rows

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
POISON = 0xA5
FMT = {"row_format": FP8_ROW, "index_format": FP8_KEYS}

# The attention reference over fp8 rows.
run_reference = functools.partial(run_bf16_reference, row_format=FP8_ROW)


def awkward_rows(n: int, seed: int) -> torch.Tensor:
    """[n, 576] bf16 rows over 10 decades, with zero blocks, -0.0, and values on fp8 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g) * torch.logspace(-7, 5, n)[:, None]
    x[n // 2] = 0  # all-zero row: scale from the 1e-4 floor
    x[n // 3, 128:256] = 0  # one zero block
    x[n // 4, 7] = -0.0
    if n > 5:
        # Block max 448 gives scale 1, so these values are rounded as they are: ties at both
        # parities, a mantissa carry into the next binade (126.6 -> 128), and subnormals.
        x[5, :16] = torch.tensor(
            [
                448.0,
                126.63,
                1.1875,
                1.0625,
                1.3125,
                2**-10,
                3 * 2**-11,
                -(2**-10),
                2**-9 * 1.5,
                2**-9 * 2.5,
                240.0,
                248.0,
                232.0,
                -0.0,
                1e-30,
                0.0146,
            ]
        )
    return x.bfloat16()


def quantize_kernel(rows: torch.Tensor) -> torch.Tensor:
    out = torch.full((rows.shape[0], FP8_ROW_BYTES), POISON, dtype=torch.uint8, device=rows.device)
    kv_quantize(rows, out)
    return out


def test_scales_are_the_smallest_fitting_power_of_two() -> None:
    amax = torch.tensor([0.0, 1e-6, 1e-4, 1.0, 447.9, 448.0, 448.5, 896.0, 1e6, 3.3e38])
    scale, inv = fp8_block_scales(amax)
    floor = amax.double().clamp(min=1e-4)
    assert torch.equal(scale.double() * inv.double(), torch.ones(10, dtype=torch.float64))
    assert torch.equal(torch.log2(scale.double()), torch.log2(scale.double()).round())
    assert (floor / scale.double() <= 448).all() and (floor / scale.double() > 224).all()


@pytest.mark.parametrize("n", [1, 6, 37])
def test_quantize_reference_against_float64(n) -> None:
    """Stated tolerance: each latent value is within half an fp8 step of x, i.e.
    |x - deq| <= max(|x| * 2^-4, scale * 2^-10); the rope part and the layout are exact."""
    rows = awkward_rows(n, seed=n)
    raw = torch.empty(n, FP8_ROW_BYTES, dtype=torch.uint8)
    ref_quantize_kv_rows(rows, raw)
    x = rows.double()
    scale = raw[:, 512:528].contiguous().view(torch.float32).double()  # [n, 4]
    codes = raw[:, :512].contiguous().view(torch.float8_e4m3fn).double().view(n, 4, 128)
    deq = (codes * scale[..., None]).view(n, 512)
    bound = torch.maximum(x[:, :512].abs() * 2**-4, scale.repeat_interleave(128, 1) * 2**-10)
    assert ((deq - x[:, :512]).abs() <= bound).all()
    assert (codes.abs() <= 448).all()
    assert torch.equal(raw[:, 528:].contiguous().view(torch.bfloat16), rows[:, 512:])
    assert torch.equal(ref_dequantize_kv_rows(raw).double()[:, :512], deq)  # exact in bf16
    assert torch.equal(ref_dequantize_kv_rows(raw)[:, 512:], rows[:, 512:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 5, 37])
def test_quantize_kernel_is_bitwise_the_reference(device, n) -> None:
    rows = awkward_rows(n, seed=10 + n).to(device)
    want = torch.empty(n, FP8_ROW_BYTES, dtype=torch.uint8, device=device)
    ref_quantize_kv_rows(rows, want)
    assert torch.equal(quantize_kernel(rows), want)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_kernel_rounds_every_fp8_midpoint_like_torch(device) -> None:
    """Every e4m3 value, the midpoints between neighbours (ties) and values just off them."""
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    ulp = torch.exp2(torch.floor(torch.log2(mids)) - 7)  # one bf16 step at the midpoint
    vals = torch.cat([grid, mids, mids - ulp, mids + ulp])
    vals = torch.cat([vals, -vals])
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 508)]).view(-1, 508)
    # 448 in every block pins its scale at 1, so the values are rounded as they are.
    pinned = torch.tensor([0, 128, 256, 384])
    free = torch.tensor([i for i in range(512) if i not in (0, 128, 256, 384)])
    x = torch.zeros(vals.shape[0], 576)
    x[:, pinned], x[:, free] = 448.0, vals
    rows = x.bfloat16().to(device)
    assert torch.equal(rows[:, free].float().cpu(), vals)  # every value survives bf16
    want = torch.empty(rows.shape[0], FP8_ROW_BYTES, dtype=torch.uint8, device=device)
    ref_quantize_kv_rows(rows, want)
    assert torch.equal(quantize_kernel(rows), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 33])
def test_append_quantizes_like_the_reference(device, n) -> None:
    """bf16 rows into 656 B tiers: kv_append writes the reference's fp8 rows at the same
    addresses (hot slot and host tier, one launch), and nothing outside them."""
    rng = random.Random(n)
    req_mode, page_table = control(device, rng.sample([0, 1, 2, 2, 1], R), n)
    rows = random_rows(rng, n)
    got, want = Tiers(device, 656, 132, seed=n), Tiers(device, 656, 132, seed=n)
    cols = [torch.tensor(c, dtype=torch.int32, device=device) for c in zip(*rows)]
    for layer in (0, L - 1):
        kv = awkward_rows(n, seed=layer + n).to(device)
        index = torch.randint(0, 256, (n, 132), dtype=torch.uint8).to(device)
        kv_append(layer, kv, index, *cols, req_mode, page_table, *got.args(True), window=W, **FMT)
        ref_kv_append(
            layer, kv, index, *cols, req_mode, page_table, *want.args(False), window=W, **FMT
        )
    a, b = got.snapshot(), want.snapshot()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def fp8_inputs(bs, heads, k, rows, device, seed, pad_frac=0.2):
    q_nope, q_pe, kv, row_base, slots = make_inputs(bs, heads, k, rows, device, seed, pad_frac)
    return q_nope, q_pe, quantize_kernel(kv), row_base, slots


@pytest.mark.parametrize(
    "bs,heads,k,rows,splits", [(1, 4, 37, 60, 1), (3, 8, 150, 400, 3), (5, 4, 64, 80, 2)]
)
def test_attention_over_fp8_rows_matches_reference(bs, heads, k, rows, splits, device) -> None:
    q_nope, q_pe, kv8, row_base, slots = fp8_inputs(bs, heads, k, rows, device, seed=k)
    slots[-1, :] = -1  # one row with no valid slot
    ws = AttnWorkspace.allocate(bs, heads, splits, device=device) if splits > 1 else None
    scale = 1.0 / math.sqrt(576)
    out, lse = run_kernel(
        q_nope, q_pe, kv8, row_base, slots, scale, workspace=ws, block_n=16, row_format=FP8_ROW
    )
    assert_close_to_reference(out, lse, *run_reference(q_nope, q_pe, kv8, row_base, slots, scale))
    # Dequantization is exact: the same bits as the bf16 kernel on the dequantized rows.
    deq = ref_dequantize_kv_rows(kv8)
    out_b, lse_b = run_kernel(q_nope, q_pe, deq, row_base, slots, scale, workspace=ws, block_n=16)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)


@pytest.mark.parametrize(
    "bs,heads,k,rows,launch", [(1, 4, 37, 60, None), (2, 8, 90, 120, LAUNCHES[1])]
)
def test_two_pass_over_fp8_rows_matches_reference(bs, heads, k, rows, launch, device) -> None:
    q_nope, q_pe, kv8, row_base, slots = fp8_inputs(bs, heads, k, rows, device, seed=k)
    slots[-1, :] = -1  # one row with no valid slot
    ws = TileWorkspace.allocate(bs, heads, k, row_format=FP8_ROW, device=device)
    args = (q_nope, q_pe, kv8, row_base, slots)
    out, lse = run_two_pass(args, 0.04, launch, row_format=FP8_ROW, ws=ws)
    assert_close_to_reference(out, lse, *run_reference(*args, 0.04))
    # Dequantization is exact (the 2^-56 of the GPU path comes back exactly): the same bits as
    # the bf16 rows the reference dequantizes to, through the same tiles.
    deq = (q_nope, q_pe, ref_dequantize_kv_rows(kv8), row_base, slots)
    out_b, lse_b = run_two_pass(deq, 0.04, launch, ws=ws)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)


def test_fp8_attention_reference_against_float64_of_the_unquantized_rows() -> None:
    """Stated tolerance of fp8 rows against exact attention over the original bf16 rows:
    relative output error < 6%, lse error < 0.05 (e4m3 keeps 3 mantissa bits)."""
    q_nope, q_pe, kv, row_base, slots = make_inputs(3, 8, 150, 300, "cpu", seed=4, pad_frac=0.1)
    kv8 = torch.empty(kv.shape[0], FP8_ROW_BYTES, dtype=torch.uint8)
    ref_quantize_kv_rows(kv, kv8)
    scale = 1.0 / math.sqrt(576)
    exact = run_bf16_reference(q_nope, q_pe, kv, row_base, slots, scale)
    fp8 = run_reference(q_nope, q_pe, kv8, row_base, slots, scale)
    rel = (fp8[0] - exact[0]).norm(dim=-1) / exact[0].norm(dim=-1)
    assert rel.max() < 0.06
    assert (fp8[1] - exact[1]).abs().max() < 0.05
    assert rel.max() > 0  # the quantization did change something


def test_fp8_padding_slots_are_never_read(device) -> None:
    q_nope, q_pe, kv8, _, slots = fp8_inputs(3, 4, 40, 50, device, seed=5)
    # A row of 0xFF bytes (NaN codes, NaN scales) before each request's rows: slot -1 would
    # address it, and any use of it would turn the output into NaN.
    bad = torch.full_like(kv8[:1], 0xFF)
    kv8 = torch.cat([t for b in range(3) for t in (bad, kv8[b * 50 : (b + 1) * 50])])
    row_base = (torch.arange(3, device=device) * 51 + 1).to(torch.int64)
    out, lse = run_kernel(q_nope, q_pe, kv8, row_base, slots, 0.1, row_format=FP8_ROW)
    assert_close_to_reference(out, lse, *run_reference(q_nope, q_pe, kv8, row_base, slots, 0.1))


def test_fp8_rows_shape_is_checked(device) -> None:
    q_nope, q_pe, kv8, row_base, slots = fp8_inputs(2, 4, 8, 16, device, seed=1)
    out = torch.empty(2, 4, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(2, 4, device=device)
    with pytest.raises(ValueError, match="fp8 rows"):
        sparse_mla_decode(
            q_nope, q_pe, kv8[:, :640], row_base, slots, 1.0, out, lse, row_format=FP8_ROW
        )
    with pytest.raises(ValueError, match="kv: expected"):
        sparse_mla_decode(q_nope, q_pe, kv8, row_base, slots, 1.0, out, lse)  # bf16 format
    with pytest.raises(ValueError, match="rows"):
        kv_quantize(kv8, torch.empty_like(kv8))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bs,splits,cfg", [(4, 1, {}), (9, 2, {}), (9, 1, dict(block_n=64, num_stages=2))]
)
def test_gpu_fp8_deepseek_shapes(bs, splits, cfg) -> None:
    args = fp8_inputs(bs, 128, 2048, 4096, "cuda", seed=bs, pad_frac=0.2)
    ws = AttnWorkspace.allocate(bs, 128, splits, device="cuda") if splits > 1 else None
    scale = 1.0 / math.sqrt(576)
    out, lse = run_kernel(*args, scale, workspace=ws, row_format=FP8_ROW, **cfg)
    assert_close_to_reference(out, lse, *run_reference(*args, scale))
    deq = ref_dequantize_kv_rows(args[2])
    out_b, lse_b = run_kernel(*args[:2], deq, *args[3:], scale, workspace=ws, **cfg)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
