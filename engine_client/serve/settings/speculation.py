"""Speculative decoding (engine_client/model/speculative_runner.py, loop/speculative.py): the
MTP layer's drafts per step, and the BENCHMARK-ONLY synthetic acceptance that only runs when
explicitly allowed."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.layout import MAX_DRAFT_TOKENS
from contract.rules import check_settings, one_of, within
from engine_client.loop.acceptance_rates import BENCHMARK_ONLY, AcceptanceRates, check_rates

SPECULATIVE = ("none", "mtp")


@dataclass(frozen=True)
class Speculation:
    speculative: str = setting(
        "none",
        choices=SPECULATIVE,
        help="mtp: the model's MTP layer drafts --draft-tokens tokens per step and each step "
        "verifies them (D + 1 rows per request); the KV layout holds the MTP layer's KV as its "
        "last layer (service modes: start the service with one more layer)",
        check=one_of(SPECULATIVE),
    )
    draft_tokens: int = setting(
        1, help="speculative: drafts per verify step, 1..3", check=within(1, MAX_DRAFT_TOKENS)
    )
    speculative_acceptance: tuple[float, ...] | None = setting(
        None,
        help="BENCHMARK-ONLY, refused without --allow-benchmark-only: accept drafts by a seeded "
        "draw instead of checking them, at these acceptance rates per draft position (e.g. 0.9 "
        "or 0.9,0.75,0.6; rate i given drafts before i were accepted; positions past the list "
        "repeat its last rate). The drafts still come from the MTP layer and are verified over "
        "D + 1 rows; the output is the accepted drafts and the model's token after them, not "
        "the model's own decoding (engine_client/loop/synthetic_acceptance.py)",
        check=check_rates,
    )
    speculative_acceptance_seed: int = setting(
        0, help="BENCHMARK-ONLY: seed of --speculative-acceptance's draws (a run repeats)"
    )
    allow_benchmark_only: bool = setting(
        False,
        help="allow BENCHMARK-ONLY settings (--speculative-acceptance), which make the output "
        "not the model's; refused without it",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.speculative_acceptance is None:
            return
        if not self.allow_benchmark_only:
            raise ValueError(
                f"--speculative-acceptance is {BENCHMARK_ONLY}: its tokens are not the model's "
                "output; pass --allow-benchmark-only to run it anyway"
            )
        if not self.spec_tokens:
            raise ValueError("--speculative-acceptance needs --speculative mtp")
        # Its own checks: at most one rate per draft position.
        AcceptanceRates(self.speculative_acceptance, self.spec_tokens)

    @property
    def acceptance(self) -> AcceptanceRates | None:
        """The BENCHMARK-ONLY synthetic acceptance rule, if set."""
        if self.speculative_acceptance is None or not self.spec_tokens:
            return None
        return AcceptanceRates(
            self.speculative_acceptance, self.spec_tokens, self.speculative_acceptance_seed
        )

    @property
    def spec_tokens(self) -> int:
        """Drafts per step: draft_tokens with --speculative mtp, else 0."""
        return self.draft_tokens if self.speculative == "mtp" else 0
