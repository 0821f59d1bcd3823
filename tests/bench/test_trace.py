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
