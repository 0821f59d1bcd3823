"""Queue policies: in what order an admission turn may try the queued requests once one of them
(the head of this turn) was refused for capacity. The scheduler asks its policy about every
request behind that head; before any refusal it tries the queue in order.

- `Fifo`: nothing passes a refused head; the capacity our running requests free goes to it.
- `SkipAhead`: smaller requests (fewer reserved tokens) may pass a refused head until it has
  waited `seconds`; from then on nothing passes it, so it cannot starve (issue 11).

Adding a policy: a class with `after_refusal`, and a name in `QUEUE_POLICIES` (the engine's
`--queue-policy` flag lists them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from engine_client.loop.request import GenRequest


class Turn(enum.Enum):
    """What the scheduler does with a queued request behind a refused head."""

    TRY = 1  # ask the KV side to admit it
    SKIP = 2  # leave it queued, look at the next one
    STOP = 3  # admit nothing more this turn


def reserved_tokens(req: GenRequest) -> int:
    """What admission reserves for a request: its prompt and every token it may generate."""
    return req.prompt_len + req.max_new_tokens


class QueuePolicy(Protocol):
    def after_refusal(self, req: GenRequest, head: GenRequest, head_waited: float) -> Turn:
        """`req` is queued behind `head`, refused this turn after waiting `head_waited` s."""


@dataclass(frozen=True)
class Fifo:
    def after_refusal(self, req: GenRequest, head: GenRequest, head_waited: float) -> Turn:
        return Turn.STOP


@dataclass(frozen=True)
class SkipAhead:
    seconds: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.seconds <= 86400:
            raise ValueError(f"skip-ahead seconds must be in [0, 86400], got {self.seconds}")

    def after_refusal(self, req: GenRequest, head: GenRequest, head_waited: float) -> Turn:
        if head_waited >= self.seconds:
            return Turn.STOP  # the head has waited long enough: capacity is kept for it
        return Turn.TRY if reserved_tokens(req) < reserved_tokens(head) else Turn.SKIP


QUEUE_POLICIES = ("fifo", "skip-ahead")


def queue_policy(name: str, skip_ahead_seconds: float) -> QueuePolicy:
    """The policy `name` (one of QUEUE_POLICIES) with its setting."""
    if name == "fifo":
        return Fifo()
    if name == "skip-ahead":
        return SkipAhead(skip_ahead_seconds)
    raise ValueError(f"queue policy must be one of {QUEUE_POLICIES}, got {name!r}")


@dataclass(frozen=True)
class QueueLimits:
    """order: the queue policy behind a refused head; max_queue_wait: seconds a request may wait
    for admission (0: no limit); admit_retry: seconds between admission retries while refused."""

    order: QueuePolicy = field(default_factory=SkipAhead)
    max_queue_wait: float = 300.0
    admit_retry: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.max_queue_wait <= 86400:
            raise ValueError(f"max_queue_wait must be in [0, 86400], got {self.max_queue_wait}")
        if not 0 < self.admit_retry <= 3600:
            raise ValueError(f"admit_retry must be in (0, 3600], got {self.admit_retry}")
