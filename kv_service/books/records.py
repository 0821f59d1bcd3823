"""What the service core keeps per session and per request, the stats it reports, and the
checks of identifiers and numbers that every entry point shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.errors import InvalidArgument, SharedRowWrite
from contract.ids import id_problem
from contract.layout import MAX_ROWS_PER_STEP, KVLayout

# Lengths beyond any layout's max_context; larger values are malformed, not merely too big.
MAX_TOKENS = 2**40


@dataclass
class RequestRecord:
    """An admitted request. `pages` is its page table in token order: the first
    cached_tokens / page_size are shared cached pages (read-only), the rest are private.
    `keys` are the scoped names of the full pages known so far (prompt pages at admission,
    generated ones at release); pages [0, published) were published or found duplicates."""

    request_id: str
    slot: int
    mode: int
    pages: list[int]
    prompt_len: int
    max_new_tokens: int
    seq_len: int = 0
    cached_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)
    published: int = 0
    # contract.prefix.namespace of the session's fingerprint and the request's salt.
    namespace: bytes = b""

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens

    def check_stored(self, seq_len: int, low: int = 0) -> None:
        """A stored length the request can reach (Commit, StepEnd, Prefilled): within [low, its
        reservation], and never below its cached prefix, whose rows are shared pages' (a length
        below it would have the engine write them again: SharedRowWrite)."""
        check_range("seq_len", seq_len, low, self.reserved_tokens)
        if seq_len < self.cached_tokens:
            raise SharedRowWrite(
                f"seq_len = {seq_len} is below the {self.cached_tokens} cached tokens of "
                f"request {self.request_id!r}: those rows are shared and read-only",
                request_id=self.request_id,
                seq_len=seq_len,
                cached_tokens=self.cached_tokens,
            )


@dataclass
class SessionRecord:
    session_id: str
    engine_name: str
    last_seen: float
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    # Open Session streams; the lease runs only while there are none.
    streams: int = 0
    # Model fingerprint given at Attach; empty: this session's requests can neither use nor
    # fill the prefix cache (nothing would keep two models from sharing pages).
    fingerprint: str = ""


@dataclass(frozen=True)
class CoreStats:
    pages_used: int
    pages_total: int
    offloaded_pages_used: int
    slots_used: int
    slots_total: int
    sessions: int
    requests: int
    hits: int
    misses: int
    bytes_moved: int
    admitted_total: int
    rejected_total: int
    expired_sessions_total: int
    draining: bool
    uptime_seconds: float
    epoch: int
    # Prefix cache: pages holding a published key, those no request uses (evictable),
    # admissions that looked up a prefix, prompt tokens looked up, tokens found cached, and
    # cached pages evicted for capacity.
    cached_pages: int = 0
    evictable_pages: int = 0
    prefix_lookups_total: int = 0
    prefix_lookup_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    evicted_pages_total: int = 0


@dataclass
class Totals:
    """The core's counters since start: Python ints, which `stats` readers clamp to their
    field."""

    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    admitted_total: int = 0
    rejected_total: int = 0
    expired_sessions_total: int = 0

    def add_step(
        self, layout: KVLayout, hits: int, misses: int, bytes_moved: int, steps: int = 1
    ) -> None:
        """Add the counters of `steps` merged steps, refusing what no step can do: every layer of
        every request slot selects at most topk positions per row, a step has at most
        MAX_ROWS_PER_STEP rows per (layer, request) (a speculative step's verify and draft rows),
        and each miss moves at most one KV row and one index key."""
        lay = layout
        check_range("steps", steps, 1, MAX_MERGED_STEPS)
        positions = steps * lay.num_layers * lay.topk * lay.max_requests * MAX_ROWS_PER_STEP
        check_range("hits", hits, 0, positions)
        check_range("misses", misses, 0, positions - hits)
        check_range("bytes_moved", bytes_moved, 0, positions * (lay.row_bytes + lay.index_bytes))
        self.hits, self.misses = self.hits + hits, self.misses + misses
        self.bytes_moved += bytes_moved


# Most steps one StepEnd may merge: far more than a stalled service makes an engine merge, and a
# bound on what the counters may grow by per message.
MAX_MERGED_STEPS = 1 << 20


def check_id(name: str, value: str) -> None:
    problem = id_problem(name, value)
    if problem is not None:
        raise InvalidArgument(problem, field=name, length=len(value.encode()))


def check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(
            f"{name} = {value} is outside [{low}, {high}]",
            field=name,
            value=value,
            min=low,
            max=high,
        )
