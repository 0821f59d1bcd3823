"""Batch-invariant matmul and norms (kernels/dense/) against their references, on irregular tiny
shapes under the interpreter (CPU) or on the GPU, and the property they exist for: a row's bits
do not depend on how many rows its batch holds, nor on which of them it is."""

from __future__ import annotations

import pytest
import torch

from kernels.dense.matmul import BLOCK_K, invariant_bmm, invariant_linear
from kernels.dense.row_norm import invariant_layer_norm, invariant_rms_norm
from kernels.reference.dense import (
    ref_invariant_bmm,
    ref_invariant_layer_norm,
    ref_invariant_linear,
    ref_invariant_rms_norm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=torch.bfloat16)


# (M, K, N): K past one BLOCK_K step with a ragged tail, N and M off every tile size.
SHAPES = [(1, 5, 3), (7, BLOCK_K + 9, 37), (19, 2 * BLOCK_K + 1, 70)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_matches_its_reference_and_torch(m, k, n) -> None:
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=k)
    got = invariant_linear(x, w)
    want = ref_invariant_linear(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    if DEVICE == "cpu":  # the interpreter walks K exactly as the reference does
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_a_row_has_the_same_bits_in_every_batch() -> None:
    """Row r of x computed alone, at the start of a short batch and deep inside a long one."""
    k, n = BLOCK_K + 23, 41
    w, rows = _bf16(n, k, seed=1), _bf16(70, k, seed=2)
    alone = torch.cat([invariant_linear(rows[i : i + 1], w) for i in (0, 5, 69)])
    for batch in (rows[:6], rows):
        out = invariant_linear(batch, w)
        assert torch.equal(out[0], alone[0]) and torch.equal(out[5], alone[1])
    assert torch.equal(invariant_linear(rows, w)[69], alone[2])
    # The reference (the CPU engine's kernels) keeps the same property.
    ref_alone = ref_invariant_linear(rows[5:6], w)
    assert torch.equal(ref_invariant_linear(rows, w)[5:6], ref_alone)


def test_bmm_on_strided_views() -> None:
    """The model's absorbed-attention shape: heads as G, a transposed view of q."""
    q, w = _bf16(3, 4, 33, seed=3), _bf16(4, 33, 18, seed=4)  # q [n, H, d], w [H, d, L]
    a = q.transpose(0, 1)
    got = invariant_bmm(a, w)
    torch.testing.assert_close(got, ref_invariant_bmm(a, w), rtol=1e-2, atol=1e-2)
    assert torch.equal(invariant_bmm(a[:, 1:2], w)[:, 0], got[:, 1])


def test_bad_inputs_are_refused() -> None:
    x = _bf16(2, 8, seed=5)
    with pytest.raises(ValueError):
        invariant_linear(x, _bf16(3, 9, seed=6))
    with pytest.raises(ValueError):
        invariant_bmm(x[None].float(), x.t()[None].float())
    with pytest.raises(ValueError):
        invariant_rms_norm(x, _bf16(7, seed=7), 1e-6)


def test_norms_match_their_references_and_keep_row_bits() -> None:
    x, w, b = _bf16(9, 50, seed=8), _bf16(50, seed=9), _bf16(50, seed=10)
    rms, ln = invariant_rms_norm(x, w, 1e-6), invariant_layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(rms, ref_invariant_rms_norm(x, w, 1e-6), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ln, ref_invariant_layer_norm(x, w, b, 1e-5), rtol=1e-2, atol=2e-2)
    want = torch.nn.functional.layer_norm(x.float(), (50,), w.float(), b.float(), 1e-5)
    torch.testing.assert_close(ln.float(), want, rtol=2e-2, atol=3e-2)
    assert torch.equal(invariant_rms_norm(x[4:5], w, 1e-6), rms[4:5])
    assert torch.equal(invariant_layer_norm(x[8:], w, b, 1e-5), ln[8:])
    # A strided view (the model norms a KV projection's first columns).
    wide = _bf16(3, 64, seed=11)
    torch.testing.assert_close(
        invariant_rms_norm(wide[:, :50], w, 1e-6), ref_invariant_rms_norm(wide[:, :50], w, 1e-6)
    )
