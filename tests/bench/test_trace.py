"""bench.shared.trace: the replayed top-k obeys the top-k contract (distinct, ascending, in range,
-1 padding) and its simulated miss rates sit near the published ones it is calibrated to."""

from __future__ import annotations

import pytest
import torch

from bench.shared.trace import TARGET_MISS, TraceParams, TraceTopk, simulate


@pytest.mark.parametrize("seq_len", [1, 5, 16, 17, 40, 300, 5000])
def test_selection_is_a_valid_topk(seq_len: int) -> None:
    k = 16
    gen = TraceTopk(num_layers=3, topk=k, device="cpu")
    out = torch.full((3, k), 7, dtype=torch.int32)
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)
    gen(1, slots, torch.full((3,), seq_len, dtype=torch.int32), out)
    for row in out[:2].tolist():
        valid = [t for t in row if t >= 0]
        assert valid == sorted(set(valid)) and all(t < seq_len for t in valid)
        assert len(valid) == min(k, seq_len)
        assert row[len(valid) :] == [-1] * (k - len(valid))  # padding at the end


def test_deterministic_per_layer_slot_and_position() -> None:
    gen = TraceTopk(num_layers=2, topk=32, device="cpu", params=TraceParams(seed=3))
    a, b = (torch.empty((2, 32), dtype=torch.int32) for _ in range(2))
    lens, slots = (
        torch.tensor([900, 900], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    gen(0, slots, lens, a)
    gen(0, slots, lens, b)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # other request slot, other trace
    gen(1, slots, lens, b)
    assert not torch.equal(a, b)  # other layer


def test_calibrated_miss_rates() -> None:
    rates = simulate(TraceParams(), k=256, context=8192, window=16, steps=160, warmup=40)
    for c, target in TARGET_MISS.items():
        assert abs(rates[c] - target) < 0.35 * target + 0.01, rates
    assert rates[1] > rates[2] > rates[4]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("per_slot", [True, False])
@pytest.mark.parametrize("k", [16, 96, 1100])
def test_the_fused_kernel_gives_the_torch_paths_integers(
    k: int, per_slot: bool, device: str
) -> None:
    """bench/shared/trace_kernel.py against TraceTopk's torch ops (its reference): irregular k
    (one block, one partial, two blocks), contexts below k, at k, at odd multiples of it (the
    stripe width w takes several powers of two), padding and large request slots."""
    params = TraceParams(seed=5, per_slot=per_slot)
    gen = TraceTopk(num_layers=3, topk=k, device=device, params=params)
    lens = torch.tensor([1, k - 3, k, 3 * k + 1, 7 * k + 5, 40 * k, 0], dtype=torch.int32)
    slots = torch.tensor([0, 3, -1, 250, 7, 1, 2], dtype=torch.int32)
    lens, slots = lens.to(device), slots.to(device)
    want, got = (torch.full((7, k), 9, dtype=torch.int32, device=device) for _ in range(2))
    for layer in (0, 2):
        gen.fused = False
        gen(layer, slots, lens, want)
        gen.fused = True
        gen(layer, slots, lens, got)
        assert torch.equal(got, want), layer


def test_the_fused_kernel_checks_its_inputs() -> None:
    from bench.shared.trace_kernel import trace_topk

    gen = TraceTopk(num_layers=1, topk=16, device="cpu")
    args = (gen.key[0], gen.phase[0], gen.moving[0])
    knobs = dict(epoch=44, flicker=0.19, alternates=3, per_slot=True)
    one = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        trace_topk(*args, one, one, torch.empty((2, 16), dtype=torch.int64), **knobs)
    with pytest.raises(ValueError, match="lane constants"):
        trace_topk(*args, one, one, torch.empty((2, 8), dtype=torch.int32), **knobs)
    with pytest.raises(ValueError, match="req_slots"):
        trace_topk(*args, one[:1], one, torch.empty((2, 16), dtype=torch.int32), **knobs)
