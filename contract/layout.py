"""The memory layout shared by the service and every engine that maps its memory.

One `KVLayout` describes every tensor the service owns. The engine adopts the descriptor it
receives at attach time and refuses one its model cannot run on.

The row and index-key formats it names are owned by `kernels.formats` (the kernels need their
bytes and may not import `contract`); they are re-exported here for the contract's users.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contract.flags import setting
from kernels.formats import (
    INDEX_FORMATS,
    MODE_FREE,
    MODE_OFFLOADED,
    MODE_RESIDENT,
    ROW_FORMATS,
    IndexFormat,
    RowFormat,
)

__all__ = [
    "INDEX_FORMATS",
    "LAYOUT_VERSION",
    "MAX_DRAFT_TOKENS",
    "MAX_ROWS_PER_STEP",
    "MODE_FREE",
    "MODE_OFFLOADED",
    "MODE_RESIDENT",
    "ROW_FORMATS",
    "IndexFormat",
    "KVLayout",
    "LayoutError",
    "RowFormat",
    "check_shared_slots",
    "needs_host_reads",
    "request_slots",
]

LAYOUT_VERSION = 1
# Most draft tokens of a speculative (MTP) verify step: its D + 1 rows per request share one
# swap-in plan, and kernels.swap.plan takes at most 4 rows per request.
MAX_DRAFT_TOKENS = 3
# Most top-k rows one engine step plans per (layer, request): a speculative step's D + 1 verify
# rows, and on the draft (MTP) layer D + 1 rows of draft prefill plus D - 1 drafting rows.
MAX_ROWS_PER_STEP = 2 * MAX_DRAFT_TOKENS


def _choices(registry: dict[str, RowFormat] | dict[str, IndexFormat]) -> str:
    return " or ".join(f.describe() for f in registry.values())


class LayoutError(ValueError):
    """A layout that cannot work, or that does not match the other side's."""


@dataclass(frozen=True)
class KVLayout:
    """Sizes of every KV tensor. All counts are per service (one GPU); each field's help says
    what it sizes (the letters are the design card's)."""

    num_layers: int = setting(help="L: layers whose KV the service holds")
    max_requests: int = setting(help="R: request slots (concurrent requests)")
    hot_slots: int = setting(help="B: hot rows per (layer, request) on the device")
    window: int = setting(help="W: newest tokens always resident (ring in slots [0, W))")
    topk: int = setting(help="k: tokens selected per (layer, request, step)")
    page_size: int = setting(help="P: tokens per page of the host tier / index pool")
    num_pages: int = setting(
        help="pages in the host tier (and the index-key pool); the host "
        "tier takes num_pages * L * P * row bytes of /dev/shm"
    )
    max_context: int = setting(help="most tokens per request (prompt + generated)")
    row_format: str = setting("bf16", help=f"KV row format: {_choices(ROW_FORMATS)}")
    index_format: str = setting("bf16", help=f"indexer key format: {_choices(INDEX_FORMATS)}")
    shared_slots: int = setting(
        0,
        help="S: hot slots per layer shared by the rows of cached prefix pages, whichever "
        "requests select them (issue 40); a multiple of hot_slots, taken from the last request "
        "slots' buffers; 0: off",
    )
    host_reads: bool = setting(
        False,
        help="let attention read the misses that find no victim straight from the host tier, "
        "so hot_slots - window may be below topk (a smaller private buffer per request; "
        "issue 40); the engine reads them through its mapping of the host tier (UVA on GPU)",
    )
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "max_requests",
            "hot_slots",
            "topk",
            "page_size",
            "num_pages",
            "max_context",
        ):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive, got {getattr(self, name)}")
        if self.window < 1:
            raise LayoutError(
                f"window must be at least 1 (the token being decoded), got {self.window}"
            )
        self._check_victims()
        if self.row_format not in ROW_FORMATS:
            raise LayoutError(
                f"row_format must be one of {sorted(ROW_FORMATS)}, got {self.row_format!r}"
            )
        if self.index_format not in INDEX_FORMATS:
            raise LayoutError(
                f"index_format must be one of {sorted(INDEX_FORMATS)}, got {self.index_format!r}"
            )
        if self.version != LAYOUT_VERSION:
            raise LayoutError(f"layout version {self.version} is not {LAYOUT_VERSION}")
        if self.hot_slots >= 2**31 or self.max_context >= 2**31:
            raise LayoutError("hot_slots and max_context must fit in int32")
        if self.shared_slots:
            check_shared_slots(self, self.shared_slots)

    def _check_victims(self) -> None:
        """Every miss needs a victim slot (hot_slots - window >= topk), unless host_reads gives
        the ones without a victim a host row: then one LRU slot suffices, and the plan's slot
        list encodes host rows as -2 - row in int32, so the host tier's rows must fit it."""
        lru = self.hot_slots - self.window
        if not self.host_reads and needs_host_reads(self.hot_slots, self.window, self.topk):
            raise LayoutError(
                f"hot_slots - window must be >= topk so every miss finds a victim "
                f"(or set host_reads): {self.hot_slots} - {self.window} < {self.topk}"
            )
        if lru < 1:
            raise LayoutError(
                f"hot_slots must exceed window (LRU slots for the misses): "
                f"{self.hot_slots} <= {self.window}"
            )
        host_rows = self.num_pages * self.num_layers * self.page_size
        if self.host_reads and host_rows > 2**31 - 2:
            raise LayoutError(
                f"host_reads names host rows in int32 slot entries: num_pages * num_layers * "
                f"page_size = {host_rows} must be <= 2^31 - 2"
            )

    @property
    def row(self) -> RowFormat:
        """The row format object: bytes, codec, kernel variant (kernels.formats)."""
        return ROW_FORMATS[self.row_format]

    @property
    def index(self) -> IndexFormat:
        return INDEX_FORMATS[self.index_format]

    @property
    def row_bytes(self) -> int:
        return self.row.row_bytes

    @property
    def index_bytes(self) -> int:
        return self.index.key_bytes

    @property
    def lru_slots(self) -> int:
        """Hot slots managed by LRU: [window, hot_slots)."""
        return self.hot_slots - self.window

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_context // self.page_size)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def host_tier_bytes(self) -> int:
        return self.num_pages * self.num_layers * self.page_size * self.row_bytes

    @property
    def hot_buffer_bytes(self) -> int:
        return self.num_layers * self.max_requests * self.hot_slots * self.row_bytes

    @property
    def index_pool_bytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_size * self.index_bytes

    @property
    def residency_bytes(self) -> int:
        """token_slot + slot_token + lru_order, int32 each."""
        per_layer = self.max_requests * (self.max_context + self.hot_slots + self.lru_slots)
        return 4 * self.num_layers * per_layer

    def fits_draft_tokens(self, draft_tokens: int) -> bool:
        try:
            self.check_draft_tokens(draft_tokens)
        except LayoutError:
            return False
        return True

    def check_draft_tokens(self, draft_tokens: int) -> str:
        """Can a verify step of `draft_tokens` drafts (D + 1 rows per request) run on this
        layout? The union of its rows' top-k must fit the LRU slots (k (D + 1) <= B - W: every
        miss finds a victim that no row of the step reads; with host_reads the misses past the
        victims are read from the host tier instead), and the window ring must hold the
        D + 1 tokens it appends (W >= D + 1, so no row's append overwrites another's and a
        rejected row's token never reaches the LRU slots). Returns the statement, for the log."""
        d, k, lru = draft_tokens, self.topk, self.lru_slots
        if not 0 <= d <= MAX_DRAFT_TOKENS:
            raise LayoutError(f"draft tokens must be in [0, {MAX_DRAFT_TOKENS}], got {d}")
        if k * (d + 1) > lru and self.host_reads and self.shared_slots and d:
            raise LayoutError(
                f"{d} draft tokens with host reads and a shared region: the union k * (D + 1) "
                f"= {k * (d + 1)} passes B - W = {lru}, and the shared region's plan scratch "
                f"holds max(B - W, k) entries a request (contract/capacity.py); use B - W >= "
                f"k * (D + 1), or no shared region"
            )
        if (k * (d + 1) > lru and not self.host_reads) or self.window < d + 1:
            raise LayoutError(
                f"{d} draft tokens need k * (D + 1) <= B - W and W >= D + 1: "
                f"{k} * {d + 1} = {k * (d + 1)} vs B - W = {self.hot_slots} - {self.window} "
                f"= {lru}, W = {self.window}"
            )
        fits = "<=" if k * (d + 1) <= lru else "> (host reads for the rest)"
        return (
            f"speculative verify with D = {d}: union k * (D + 1) = {k * (d + 1)} {fits} "
            f"B - W = {lru}, window W = {self.window} >= D + 1 = {d + 1}"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(**d)

    def check_matches(self, other: "KVLayout") -> None:
        if self != other:
            diff = {
                f.name: (getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)
            }
            raise LayoutError(f"layout mismatch (ours, theirs): {diff}")


def needs_host_reads(hot_slots: int, window: int, topk: int) -> bool:
    """Whether a hot buffer of these sizes leaves a step's misses without enough victims
    (B - W < k), so that only the layout's host_reads can serve the rest."""
    return hot_slots - window < topk


def check_shared_slots(layout: KVLayout, slots: int) -> None:
    """The shared hot region (contract.shared_region) is whole request buffers, leaving at
    least one request slot; the size rule lives here, where torch-free configs can check it."""
    B, R = layout.hot_slots, layout.max_requests
    if slots <= 0 or slots % B or slots // B >= R:
        raise LayoutError(
            f"shared_slots must be a positive multiple of hot_slots ({B}) below "
            f"max_requests * hot_slots ({R * B}), got {slots}"
        )


def request_slots(layout: KVLayout, shared_slots: int | None = None) -> int:
    """Request slots left for requests when `shared_slots` (default: the layout's) hot slots
    form the shared region."""
    slots = layout.shared_slots if shared_slots is None else shared_slots
    return layout.max_requests - slots // layout.hot_slots
