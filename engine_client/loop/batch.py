"""One engine step, as the scheduler builds it and the step runner launches it: at most one
prefill chunk, and one decode row (or D + 1 rows, speculative) per running request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_client.loop.request import GenRequest


@dataclass
class Batch:
    """One step: `prefill` runs prompt positions prefill_range (after filling the `synthetic`
    context regions (start, end, seed), if any); `decode` rows append ids[i] (-1: on the device) at
    positions[i] of slots[i]. temps/keys: the rows' sampling, None when every row is greedy.
    first: (temperature, key) of the prefill's first token when this chunk ends the prompt.
    rows_per_request: forward rows per decode request (a speculative verify step's D + 1: the
    token at positions[i] and D drafts on the device); temps/keys then hold one entry per row."""

    step: int
    prefill: GenRequest | None = None
    prefill_range: tuple[int, int] = (0, 0)
    synthetic: tuple[tuple[int, int, int], ...] = ()
    first: tuple[float, int] | None = None
    decode: list[GenRequest] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    temps: list[float] | None = None
    keys: list[int] | None = None
    rows_per_request: int = 1

    @property
    def requests(self) -> list[GenRequest]:
        return ([self.prefill] if self.prefill is not None else []) + self.decode
