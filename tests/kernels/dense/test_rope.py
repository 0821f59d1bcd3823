"""kernels.dense.rope.rotate against its reference (ref_rotate, PyTorch's expression): bit for
bit, on irregular sizes, both pairings, strided views, in place and out of place."""

from __future__ import annotations

import pytest
import torch

from engine_client.model.rope import RopeTable
from kernels.dense.rope import rotate
from kernels.reference import ref_rotate


def _table(n: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 5000, (n,), generator=g)
    return RopeTable(r, 5000, 10000.0).lookup(pos)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 4).to(torch.bfloat16)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [0, 1, 3, 17])
def test_rotate_equals_the_reference_bitwise(interleaved: bool, heads: int) -> None:
    """[n, H, 64] out of place from a strided view (q_pe: the last 64 of 96 columns); [n, 64]
    for H = 0 (the KV row's k_pe); H = 17 spans two programs' head blocks."""
    n, r = 5, 64
    cos, sin = _table(n, r, seed=heads)
    wide = _bf16(n, max(heads, 1), 96, seed=heads + 1)
    x = wide[..., 32:] if heads else wide[:, 0, 32:]
    got = rotate(x, cos, sin, interleaved)
    assert got.is_contiguous() and got.shape == x.shape
    assert torch.equal(got, ref_rotate(x, cos, sin, interleaved))
    assert not torch.equal(got, x)  # it rotated something


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotate_in_place_touches_only_the_rotary_dims(interleaved: bool) -> None:
    """The indexer's use: the first r dims of q [n, H, 128] rotate in place, the rest stay."""
    n, h, r = 7, 5, 16
    cos, sin = _table(n, r, seed=3)
    q = _bf16(n, h, 40, seed=4)
    want = q.clone()
    want[..., :r] = ref_rotate(q[..., :r], cos, sin, interleaved)
    assert rotate(q[..., :r], cos, sin, interleaved, out=q[..., :r]).data_ptr() == q.data_ptr()
    assert torch.equal(q, want)


def test_an_empty_batch_is_a_no_op() -> None:
    cos, sin = _table(0, 8, seed=5)
    assert rotate(torch.empty(0, 3, 8, dtype=torch.bfloat16), cos, sin, True).shape == (0, 3, 8)


def test_bad_inputs_are_refused() -> None:
    cos, sin = _table(4, 8, seed=6)
    x = _bf16(4, 2, 8, seed=7)
    with pytest.raises(ValueError, match="power of two"):
        rotate(_bf16(4, 2, 6, seed=7), *_table(4, 6, seed=6), True)
    with pytest.raises(ValueError, match="cos"):
        rotate(x, cos[:3], sin, True)
    with pytest.raises(ValueError, match="cos"):
        rotate(x, cos.double(), sin, True)
    with pytest.raises(ValueError, match="out"):
        rotate(x, cos, sin, True, out=torch.empty(4, 2, 8))
    with pytest.raises(ValueError, match="unit last stride"):
        rotate(_bf16(4, 8, 2, seed=7).transpose(1, 2), cos, sin, True)  # [4, 2, 8], stride 2


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotate_equals_the_reference_bitwise_on_gpu(interleaved: bool) -> None:
    """On the GPU the products must not fuse into FMAs (the reference rounds each one)."""
    n, h, r = 222, 128, 64
    cos, sin = (t.cuda() for t in _table(n, r, seed=8))
    q = _bf16(n, h, 192, seed=9).cuda()
    x = q[..., 128:]
    assert torch.equal(rotate(x, cos, sin, interleaved), ref_rotate(x, cos, sin, interleaved))
    k = _bf16(n, 128, seed=10).cuda()
    want = ref_rotate(k[:, :r], cos, sin, interleaved)
    rotate(k[:, :r], cos, sin, interleaved, out=k[:, :r])
    assert torch.equal(k[:, :r], want)
