"""Device sampling (engine_client/loop/sampler.py): a correct draw from softmax(logits / T), a pure
function of (logits, seed, index), and row-independent inside a batch."""

from __future__ import annotations

import torch

from engine_client.loop.sampler import gumbel, sample_rows, token_key


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    for temp in (0.5, 1.0, 2.0):
        n = 20000
        keys = torch.tensor([token_key(11, i) for i in range(n)])
        rows = logits.expand(n, -1).contiguous()
        draws = sample_rows(rows, torch.full((n,), temp), keys)
        freq = torch.bincount(draws, minlength=5).double() / n
        expect = torch.softmax(logits.double() / temp, dim=0)
        # 20000 draws: the standard error of each frequency is below 0.0036.
        assert torch.allclose(freq, expect, atol=0.015), (temp, freq, expect)


def test_noise_is_a_function_of_key_and_token_and_uniform_enough() -> None:
    keys = torch.tensor([token_key(1, 0), token_key(1, 1), token_key(2, 0)])
    g = gumbel(keys, 4096)
    assert torch.equal(g, gumbel(keys, 4096))
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.isfinite(g).all()
    # Gumbel(0, 1): mean is the Euler-Mascheroni constant, variance pi^2 / 6.
    assert abs(g.mean().item() - 0.5772) < 0.03 and abs(g.var().item() - 1.6449) < 0.1


def test_rows_are_independent_of_their_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.9])
    keys = torch.tensor(
        [token_key(s, i) for s, i in [(0, 0), (5, 3), (5, 4), (1, 1), (9, 0), (2, 7)]]
    )
    batch = sample_rows(logits, temps, keys)
    alone = [
        int(sample_rows(logits[i : i + 1], temps[i : i + 1], keys[i : i + 1])[0]) for i in range(6)
    ]
    assert batch.tolist() == alone
    assert batch[0] == logits[0].argmax() and batch[3] == logits[3].argmax()  # greedy rows
    assert torch.equal(sample_rows(logits), logits.argmax(dim=-1))
