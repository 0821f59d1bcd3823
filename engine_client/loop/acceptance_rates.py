"""The settings of the BENCHMARK-ONLY synthetic acceptance (`AcceptanceRates`): rates per draft
position and the draws' seed, with their checks. Torch-free, so the engine's config (and `serve
--help`) can hold and check them; the rule itself runs on the device in
engine_client.loop.synthetic_acceptance, whose docstring says what it accepts and emits."""

from __future__ import annotations

from dataclasses import dataclass

from contract.layout import MAX_DRAFT_TOKENS

BENCHMARK_ONLY = "BENCHMARK-ONLY"


def check_rates(name: str, rates: tuple[float, ...]) -> None:
    """1..MAX_DRAFT_TOKENS rates, each in [0, 1] (a setting's rule, contract.rules)."""
    if not 1 <= len(rates) <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"{name} takes 1..{MAX_DRAFT_TOKENS} comma-separated acceptance rates, one per "
            f"draft position (e.g. 0.9 or 0.9,0.75,0.6), got {len(rates)}"
        )
    bad = [r for r in rates if not 0.0 <= r <= 1.0]  # NaN fails too
    if bad:
        raise ValueError(f"{name}: every acceptance rate must be in [0, 1], got {bad[0]}")


@dataclass(frozen=True)
class AcceptanceRates:
    """The rule's settings: conditional rates per draft position (rates[i]: draft i accepted
    given the drafts before it were) for D = draft_tokens drafts, and the draws' seed."""

    rates: tuple[float, ...]
    draft_tokens: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_rates("speculative_acceptance", self.rates)
        if len(self.rates) > self.draft_tokens:
            raise ValueError(
                f"speculative_acceptance gives {len(self.rates)} rates for "
                f"{self.draft_tokens} draft position(s): at most one per draft"
            )

    @property
    def per_position(self) -> tuple[float, ...]:
        """One rate per draft position: positions past the given rates repeat the last."""
        return self.rates + (self.rates[-1],) * (self.draft_tokens - len(self.rates))

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens a verify step yields per request: 1 + the sum over i of the
        probability that drafts 0 .. i are all accepted."""
        total = reach = 1.0
        for rate in self.per_position:
            reach *= rate
            total += reach
        return total

    def describe(self) -> str:
        rates = ",".join(f"{r:g}" for r in self.per_position)
        return (
            f"{BENCHMARK_ONLY} synthetic acceptance: rates {rates} per draft position "
            f"(seed {self.seed}), {self.tokens_per_step:.2f} tokens per step expected; drafts "
            "are accepted by draw, not checked against the target, so the output is not the "
            "model's"
        )
