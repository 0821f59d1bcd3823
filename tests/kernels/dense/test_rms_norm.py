"""kernels.dense.rms_norm.rms_norm: the model's default RMSNorm with PyTorch's bits in fewer
launches, against ref_rms_norm (the PyTorch expression) bit for bit on irregular sizes, strided
rows (the model norms a KV projection's first 512 columns), large magnitudes and padding rows."""

from __future__ import annotations

import pytest
import torch

from kernels.dense.rms_norm import rms_norm
from kernels.reference import ref_rms_norm


def _bf16(*shape: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("n,d", [(1, 7), (5, 64), (9, 1030), (3, 2500)])
def test_rms_norm_equals_the_reference_bitwise(n: int, d: int) -> None:
    """d = 1030 and 2500 span two and three column blocks of a row."""
    x, w = _bf16(n, d, seed=d), _bf16(d, seed=d + 1, scale=1.0)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == x.dtype and got.is_contiguous()
    assert torch.equal(got, ref_rms_norm(x, w, 1e-6))


def test_strided_rows_and_extreme_rows() -> None:
    wide = _bf16(6, 576, seed=1)
    wide[1] *= 1e4  # large values: the square must not overflow the bf16 input's range in fp32
    wide[2] = 0  # a padding row: rsqrt(eps) times zeros
    x, w = wide[:, :512], _bf16(512, seed=2, scale=1.0)
    assert torch.equal(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
    assert torch.equal(rms_norm(x, w, 1e-6)[2], torch.zeros(512, dtype=torch.bfloat16))


def test_fp32_rows_and_an_empty_batch() -> None:
    x, w = _bf16(4, 300, seed=3).float(), _bf16(300, seed=4)
    assert torch.equal(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))
    assert rms_norm(torch.empty(0, 300), w, 1e-5).shape == (0, 300)


def test_bad_inputs_are_refused() -> None:
    x = _bf16(4, 16, seed=5)
    with pytest.raises(ValueError):
        rms_norm(x, _bf16(15, seed=6), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x.t(), _bf16(4, seed=6), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x[None], _bf16(16, seed=6), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 61, 222])
def test_rms_norm_equals_the_reference_bitwise_on_gpu(n: int) -> None:
    """At the bench model's widths: the reduction is PyTorch's own on the same fp32 squares,
    and the kernels' products must not fuse."""
    for d in (7168, 1536, 512):
        x, w = _bf16(n, d, seed=n + d).cuda(), _bf16(d, seed=d, scale=1.0).cuda()
        assert torch.equal(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
    wide = _bf16(n, 576, seed=n).cuda()
    w = _bf16(512, seed=9, scale=1.0).cuda()
    assert torch.equal(rms_norm(wide[:, :512], w, 1e-6), ref_rms_norm(wide[:, :512], w, 1e-6))
