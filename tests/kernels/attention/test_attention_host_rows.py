"""sparse_mla_decode reading some rows straight from the host tier (slot <= -2 names host row
-2 - slot): the same bits as with those rows copied into kv, close to the reference, -1 still
skipped, on every kernel path and both row formats (kernels/attention/sparse.py)."""

from __future__ import annotations

import math

import pytest
import torch

import kernels  # noqa: F401  (sets TRITON_INTERPRET without CUDA)
from kernels.attention.sparse import (
    AttnWorkspace,
    LaunchConfig,
    TileWorkspace,
    sparse_mla_decode,
)
from kernels.formats import BF16_ROW, FP8_ROW, RowFormat
from tests.kernels.attention.test_sparse_attention import (
    assert_close_to_reference,
    make_inputs,
    run_kernel,
    run_reference,
)

FORMATS = {"bf16": BF16_ROW, "fp8": FP8_ROW}
# two_pass_prefetch: the score pass's register prefetch and the flat mix loop (LaunchConfig).
PATHS = ("fused", "split", "two_pass", "two_pass_prefetch")
SCALE = 1.0 / math.sqrt(576)


def stored(rows: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """bf16 rows [n, 576] as `fmt` has attention read them."""
    if fmt.quantize is None:
        return rows
    out = torch.empty(rows.shape[0], fmt.row_bytes, dtype=torch.uint8, device=rows.device)
    fmt.quantize(rows, out)
    return out


def poison(t: torch.Tensor, rows) -> None:
    """NaN in every value of t's rows `rows`, either format (0xff: NaN as e4m3, fp32 and bf16)."""
    t[rows] = float("nan") if t.is_floating_point() else 0xFF


def inputs(fmt: RowFormat, device, seed: int, bs: int = 4, heads: int = 5, k: int = 37):
    """q_nope, q_pe, kv, row_base, slots; request 1 selects k rows, request 2 none (all -1)."""
    q_nope, q_pe, kv, row_base, slots = make_inputs(bs, heads, k, 50, device, seed=seed)
    slots[1] = torch.randperm(50, generator=torch.Generator().manual_seed(seed))[:k].to(slots)
    slots[2] = -1
    return q_nope, q_pe, stored(kv, fmt), row_base, slots


def move_to_host(kv, row_base, slots, moved, host_below: bool, seed: int):
    """The same selection with the entries `moved` read from a host tier: (kv, host, slots).
    Host and kv are views of one buffer (host_off below or above zero); the moved rows sit
    shuffled among spare ones, poisoned in kv, and host's row -1 is poisoned too (where a -1
    entry misread as a host row would land)."""
    g = torch.Generator().manual_seed(seed)
    src = (row_base[:, None] + slots.long())[moved]
    n_host = src.numel() + 3
    at = torch.randperm(n_host, generator=g)[: src.numel()].to(slots.device)
    buf = kv.new_empty(kv.shape[0] + n_host + 1, kv.shape[1])
    nan_row, host_at = (0, 1) if host_below else (kv.shape[0], kv.shape[0] + 1)
    kv_at = n_host + 1 if host_below else 0
    host, hot = buf[host_at : host_at + n_host], buf[kv_at : kv_at + kv.shape[0]]
    poison(buf, nan_row)
    host.copy_(kv[torch.randint(kv.shape[0], (n_host,), generator=g)])
    host[at] = kv[src]
    hot.copy_(kv)
    poison(hot, src)
    moved_slots = slots.clone()
    moved_slots[moved] = (-2 - at).to(slots.dtype)
    return hot, host, moved_slots


def host_entries(slots: torch.Tensor, seed: int) -> torch.Tensor:
    """Entries to read from the host tier: about 40% of request 0's and 3's valid ones, all of
    request 1's (every entry a host row), none of request 2's (all -1)."""
    g = torch.Generator().manual_seed(seed)
    moved = (torch.rand(slots.shape, generator=g) < 0.4).to(slots.device) & (slots >= 0)
    moved[1] = slots[1] >= 0
    return moved


def workspace(path: str, fmt: RowFormat, q_nope, k: int):
    bs, heads, _ = q_nope.shape
    if path == "split":
        return AttnWorkspace.allocate(bs, heads, 3, device=q_nope.device)
    if path == "two_pass":
        return TileWorkspace.allocate(bs, heads, k, row_format=fmt, device=q_nope.device)
    if path == "two_pass_prefetch":  # 16-row tiles: a program runs several (k 37 on CPU)
        bt = 64 if q_nope.is_cuda else 16
        return TileWorkspace.allocate(
            bs, heads, k, row_format=fmt, block_t=bt, device=q_nope.device
        )
    return None


def decode(args, fmt: RowFormat, path: str, host=None):
    """out, lse of the kernels; small blocks and stages give the fused paths several steps."""
    knobs = {} if path == "two_pass" else dict(block_n=16, slot_stage=32)
    if path == "two_pass_prefetch":
        flat = dict(score_prefetch=True, mix_flat=True)  # both flat loops, over host rows too
        knobs = dict(launch=LaunchConfig(chunk=1024, mix_cols=512, **flat))
    ws = workspace(path, fmt, args[0], args[-1].shape[1])
    return run_kernel(*args, SCALE, row_format=fmt, workspace=ws, host=host, **knobs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_host_rows_give_the_bits_of_copied_rows_and_match_the_reference(fmt, path, device):
    fmt = FORMATS[fmt]
    seed = PATHS.index(path) * 10 + fmt.row_bytes
    q_nope, q_pe, kv, row_base, slots = inputs(fmt, device, seed)
    moved = host_entries(slots, seed)
    out, lse = decode((q_nope, q_pe, kv, row_base, slots), fmt, path)
    assert torch.isfinite(lse[[0, 1, 3]]).all() and (lse[2] == float("-inf")).all()
    assert (out[2] == 0).all()
    for host_below in (True, False):
        hot, host, host_slots = move_to_host(kv, row_base, slots, moved, host_below, seed)
        args = (q_nope, q_pe, hot, row_base, host_slots)
        out_h, lse_h = decode(args, fmt, path, host=host)
        assert torch.equal(out_h, out) and torch.equal(lse_h, lse), f"host below kv: {host_below}"
        ref = run_reference(*args, SCALE, row_format=fmt, host=host)
        assert_close_to_reference(out_h, lse_h, *ref)


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_the_reference_reads_host_rows_as_copied_ones(fmt, device):
    fmt = FORMATS[fmt]
    q_nope, q_pe, kv, row_base, slots = inputs(fmt, device, seed=3)
    hot, host, host_slots = move_to_host(kv, row_base, slots, host_entries(slots, 3), False, 3)
    want = run_reference(q_nope, q_pe, kv, row_base, slots, SCALE, row_format=fmt)
    got = run_reference(q_nope, q_pe, hot, row_base, host_slots, SCALE, row_format=fmt, host=host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("path", PATHS)
def test_without_host_entries_a_host_changes_no_bit(path, device):
    """Only -1 and hot entries: the HOST_ROWS kernels give the bits of the plain ones."""
    args = inputs(BF16_ROW, device, seed=5)
    host = torch.zeros(4, args[2].shape[1], dtype=args[2].dtype, device=device)
    out, lse = decode(args, BF16_ROW, path)
    out_h, lse_h = decode(args, BF16_ROW, path, host=host)
    assert torch.equal(out_h, out) and torch.equal(lse_h, lse)


def test_without_a_host_every_negative_entry_is_skipped(device):
    """Today's encoding stays: with no host tier, -2 and below are padding like -1."""
    q_nope, q_pe, kv, row_base, slots = inputs(BF16_ROW, device, seed=7)
    other = torch.where(slots < 0, torch.full_like(slots, -9), slots)
    for path in ("fused", "two_pass"):
        want = decode((q_nope, q_pe, kv, row_base, slots), BF16_ROW, path)
        got = decode((q_nope, q_pe, kv, row_base, other), BF16_ROW, path)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def bad_hosts(kv: torch.Tensor) -> dict[str, torch.Tensor]:
    n, width = 6, kv.shape[1]
    wide = torch.zeros(n, width + 8, dtype=kv.dtype, device=kv.device)
    flat = torch.zeros(n * width + 1, dtype=kv.dtype, device=kv.device)
    return {
        "dtype": torch.zeros(n, width, dtype=torch.float32, device=kv.device),
        "1-d": flat[: n * width],
        "width": torch.zeros(n, width - 2, dtype=kv.dtype, device=kv.device),
        "strides": wide[:, :width],
        "misaligned": flat[1:].view(n, width),  # 2 B from a 16-byte boundary
    }


@pytest.mark.parametrize("what", ["dtype", "1-d", "width", "strides", "misaligned"])
def test_a_bad_host_is_refused(what, device):
    q_nope, q_pe, kv, row_base, slots = inputs(BF16_ROW, device, seed=1)
    out = torch.empty(*q_nope.shape, dtype=torch.bfloat16, device=device)
    lse = torch.empty(*q_nope.shape[:2], device=device)
    with pytest.raises(ValueError, match="host"):
        sparse_mla_decode(
            q_nope, q_pe, kv, row_base, slots, SCALE, out, lse, host=bad_hosts(kv)[what]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
@pytest.mark.parametrize("path", PATHS)
def test_gpu_pinned_host_rows_give_the_bits_of_copied_rows(fmt, path):
    """The host tier as it runs: pinned CPU memory the kernels read over PCIe (UVA)."""
    from kernels.uva import UVATensor

    fmt = FORMATS[fmt]
    q_nope, q_pe, kv, row_base, slots = make_inputs(5, 128, 2048, 4096, "cuda", seed=4)
    kv = stored(kv, fmt)
    args = (q_nope, q_pe, kv, row_base, slots)
    out, lse = decode(args, fmt, path)
    moved = host_entries(slots, 4)
    hot, host, host_slots = move_to_host(kv, row_base, slots, moved, False, 4)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    args = (q_nope, q_pe, hot, row_base, host_slots)
    out_h, lse_h = decode(args, fmt, path, host=UVATensor(pinned))
    assert torch.equal(out_h, out) and torch.equal(lse_h, lse)
    assert_close_to_reference(
        out_h, lse_h, *run_reference(*args, SCALE, row_format=fmt, host=pinned)
    )
