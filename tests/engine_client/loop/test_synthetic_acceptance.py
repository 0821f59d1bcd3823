"""The BENCHMARK-ONLY synthetic acceptance (engine_client.loop.synthetic_acceptance): its flags and
their checks, the refusal without --allow-benchmark-only, seeded draws that depend on the
request alone, the edge rates, and the tokens it emits (accepted drafts, then the target's)."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine_client.cli.main import add_serve, engine_config
from engine_client.loop.acceptance_rates import AcceptanceRates
from engine_client.loop.sampler import token_key
from engine_client.loop.synthetic_acceptance import SyntheticAcceptance

VOCAB = 6


def serve(*argv: str):
    parser = argparse.ArgumentParser(prog="engine")
    add_serve(parser.add_subparsers(dest="command"), {})
    args = parser.parse_args(["serve", "--uds", "/tmp/unused.sock", "--kv-mode", "baseline", *argv])
    return engine_config(args, {})


SPEC = ("--speculative", "mtp", "--draft-tokens", "3")


def test_the_flags_parse_and_are_checked() -> None:
    cfg = serve(*SPEC, "--speculative-acceptance", "0.9,0.75", "--allow-benchmark-only", "1")
    rule = cfg.speculation.acceptance
    assert rule is not None and rule.rates == (0.9, 0.75) and rule.seed == 0
    assert rule.per_position == (0.9, 0.75, 0.75)  # past the list: its last rate
    assert rule.tokens_per_step == pytest.approx(1 + 0.9 + 0.9 * 0.75 + 0.9 * 0.75**2)
    assert "BENCHMARK-ONLY" in rule.describe()
    seeded = serve(
        *SPEC, "--speculative-acceptance", "1", "--speculative-acceptance-seed", "7",
        "--allow-benchmark-only", "1",
    )  # fmt: skip
    assert seeded.speculation.acceptance == AcceptanceRates((1.0,), 3, 7)
    assert serve(*SPEC).speculation.acceptance is None
    bad = {
        "1.5": "must be in \\[0, 1\\], got 1.5",
        "-0.1": "got -0.1",
        "nan": "got nan",
        "0.9,0.8,0.7,0.6": "1..3 comma-separated",
    }
    for value, why in bad.items():
        with pytest.raises(ValueError, match=why):
            serve(*SPEC, "--speculative-acceptance", value, "--allow-benchmark-only", "1")
    with pytest.raises(SystemExit):  # not a number: argparse's usage error
        serve(*SPEC, "--speculative-acceptance", "0.9,x", "--allow-benchmark-only", "1")
    # More rates than draft positions, and speculation off.
    with pytest.raises(ValueError, match="2 rates for 1 draft position"):
        serve("--speculative", "mtp", "--speculative-acceptance", "0.9,0.8",
              "--allow-benchmark-only", "1")  # fmt: skip
    with pytest.raises(ValueError, match="needs --speculative mtp"):
        serve("--speculative-acceptance", "0.9", "--allow-benchmark-only", "1")


def test_serve_refuses_it_without_the_explicit_flag() -> None:
    with pytest.raises(ValueError, match="BENCHMARK-ONLY.*--allow-benchmark-only"):
        serve(*SPEC, "--speculative-acceptance", "0.9")
    help_text = argparse.ArgumentParser(prog="engine")
    add_serve(sub := help_text.add_subparsers(dest="command"), {})
    serve_help = sub.choices["serve"].format_help()
    # argparse wraps lines at hyphens too: compare without any whitespace.
    flat = "".join(serve_help.split())
    assert "BENCHMARK-ONLY,refusedwithout--allow-benchmark-only" in flat
    assert "--allow-benchmark-onlyALLOW_BENCHMARK_ONLYallowBENCHMARK-ONLY" in flat


def rule(rates: tuple[float, ...], d: int, seed: int = 0, requests: int = 4) -> SyntheticAcceptance:
    acc = SyntheticAcceptance(AcceptanceRates(rates, d, seed), requests, torch.device("cpu"))
    for slot in range(requests):
        acc.start(slot, (3, 1, 4, slot), sampling_seed=0)
    return acc


def logits_for(targets: torch.Tensor) -> torch.Tensor:
    """One-hot-ish logits [n (D + 1), VOCAB] whose argmax per row is targets [n, D + 1]."""
    out = torch.full((targets.numel(), VOCAB), -5.0)
    out[torch.arange(targets.numel()), targets.reshape(-1)] = 5.0
    return out


def test_rate_one_accepts_every_draft_and_rate_zero_none() -> None:
    """The tokens: the accepted drafts, then the target's token of row a (never a rejected
    draft); at rate 0 the target's first token alone, as plain decoding gives."""
    targets = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2]])
    drafts = torch.tensor([[3, 3, 3], [4, 4, 4]])  # none equals the target's choice
    slots, pos = torch.tensor([0, 1]), torch.tensor([10, 20])
    y, a = rule((1.0,), 3).verify(logits_for(targets), drafts, slots, pos)
    assert a.tolist() == [3, 3] and y.tolist() == [[3, 3, 3, 4], [4, 4, 4, 2]]
    y, a = rule((0.0,), 3).verify(logits_for(targets), drafts, slots, pos)
    assert a.tolist() == [0, 0] and y[:, 0].tolist() == [1, 5]
    # A missing draft (-1) is never accepted, whatever the rate.
    y, a = rule((1.0,), 3).verify(
        logits_for(targets), torch.tensor([[3, -1, 3], [4, 4, 4]]), slots, pos
    )
    assert a.tolist() == [1, 3] and y[0, :2].tolist() == [3, 2]


def test_draws_are_seeded_per_request_and_position() -> None:
    """Same seed, same accepted counts, whatever the batch order or the logits; another seed
    draws differently; the mean over many positions follows the rates."""
    D, n = 3, 4
    rates = (0.8, 0.5, 0.5)
    targets = torch.randint(0, VOCAB, (n, D + 1), generator=torch.Generator().manual_seed(0))
    drafts = torch.zeros((n, D), dtype=torch.int64)

    def counts(seed: int, order: list[int], pos: int) -> list[int]:
        slots = torch.tensor(order)
        logits = logits_for(targets[order])
        _, a = rule(rates, D, seed).verify(logits, drafts, slots, torch.full((n,), pos))
        return [int(a[order.index(s)]) for s in range(n)]

    runs = [[counts(0, [0, 1, 2, 3], p) for p in range(200)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] == [counts(0, [2, 0, 3, 1], p) for p in range(200)]
    assert runs[0] != [counts(1, [0, 1, 2, 3], p) for p in range(200)]
    mean = sum(sum(c) for c in runs[0]) / (200 * n)
    expected = AcceptanceRates(rates, D).tokens_per_step - 1
    assert abs(mean - expected) < 0.1, (mean, expected)  # 800 draws of a fixed key: not flaky
    # A request's key is its own: another prompt, another stream.
    acc = rule(rates, D)
    assert acc.request_key((3, 1, 4, 0), 0) != acc.request_key((3, 1, 4, 1), 0)
    assert acc.request_key((3, 1, 4, 0), 0) != acc.request_key((3, 1, 4, 0), 5)


def test_a_sampled_row_draws_the_target_token_with_its_key() -> None:
    """A sampled request's token after the accepted drafts is drawn from its row's
    distribution with the row's token key, as plain sampling would."""
    from engine_client.loop.sampler import sample_rows

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    temps = torch.tensor([0.8, 0.8])
    keys = torch.tensor([token_key(9, 0), token_key(9, 1)])
    y, a = rule((0.0,), 1).verify(
        logits, torch.tensor([[2]]), torch.tensor([0]), torch.tensor([5]), temps, keys
    )
    assert a.tolist() == [0] and y[0, 0] == sample_rows(logits, temps, keys)[0]
