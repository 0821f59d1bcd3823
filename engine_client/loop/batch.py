"""One engine step's work (`Batch`): the prefill chunks and the decode rows it runs.

A step carries the prefill chunks of several requests, in queue order, while their tokens fit
one prefill chunk's budget (`PrefillBudget`): a burst of short prompts (the next turns of many
conversations, each a few hundred new tokens after its cached history) is prefilled a few per
step instead of one per step, which made the last of N prompts wait N steps, each with a full
decode pass, for its first token (issue 40, item 3). Each chunk is still its own forward over
its own positions, in the shapes it has alone: packing changes no row's bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_client.loop.request import GenRequest

# Most prefill chunks one step carries: each is a forward of its own (every weight read once
# more), so a step of many one-token chunks would cost the decode rows far more than its tokens.
MAX_PREFILLS_PER_STEP = 8


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, end) of `req`, after filling the `synthetic` context regions
    (start, end, seed), if any. first: (temperature, key) of the request's first token when
    the chunk ends its prompt (context)."""

    req: GenRequest
    start: int
    end: int
    synthetic: tuple[tuple[int, int, int], ...] = ()
    first: tuple[float, int] | None = None

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class PrefillBudget:
    """The prefill tokens one step carries: at most `size` (the prefill chunk) in at most
    MAX_PREFILLS_PER_STEP chunks. The first chunk always fits; a chunk that fills a synthetic
    context (a benchmark's, thousands of rows) costs the whole budget."""

    size: int
    used: int = 0
    chunks: int = 0

    def take(self, chunk: PrefillChunk) -> bool:
        """Charge `chunk` if it fits; False (and no charge) if not."""
        cost = self.size if chunk.synthetic else chunk.tokens
        if self.chunks and (self.used + cost > self.size or self.chunks >= MAX_PREFILLS_PER_STEP):
            return False
        self.used, self.chunks = self.used + cost, self.chunks + 1
        return True


@dataclass
class Batch:
    """One step: the `prefills` chunks, then `decode` rows that append ids[i] (-1: on the
    device) at positions[i] of slots[i]. temps/keys: the rows' sampling, None when every row is
    greedy. rows_per_request: forward rows per decode request (a speculative verify step's D + 1:
    the token at positions[i] and D drafts on the device); temps/keys then hold one entry per
    row."""

    step: int
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode: list[GenRequest] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    temps: list[float] | None = None
    keys: list[int] | None = None
    rows_per_request: int = 1

    @property
    def requests(self) -> list[GenRequest]:
        return [c.req for c in self.prefills] + self.decode

    @property
    def ends_a_prompt(self) -> bool:
        """A prefill chunk samples its request's first token (and, speculative, drafts)."""
        return any(c.first is not None for c in self.prefills)
