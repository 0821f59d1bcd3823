"""The shared hot region of prefix sharing, round 2 (issue 40, item 1): per layer, S hot slots
that hold rows of cached, read-only prefix pages once, whichever requests select them.

The region occupies the hot buffers of the last S / B request slots (`base` = R - S / B and up),
which the ledger then never hands out: the hot tensor, the miss copy and attention stay as they
are (a shared slot is written in a request's slot list relative to its own buffer, see
kernels/reference/shared_swap.py for the plan's rules and the meaning of each tensor).

`page_gen` is bumped whenever a page goes back to the free pool: a shared slot keyed by a page's
old generation never hits again, so a freed page that is reused (and maybe published again with
other rows) cannot be read through a stale slot. Stale slots are the least recently read ones
and are evicted first.

`KVLayout.shared_slots` sizes it. An embedded engine allocates it with its KV tensors; a
service exports its state tensors (`region_specs`) to the one session that plans with it
(kv_service/memory/region_lease.py), or plans with it itself for a remote-swap session.
`scratch` is the Triton plan's workspace, the planning process's own, never shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contract.capacity import scratch_sizes
from contract.layout import KVLayout, check_shared_slots

INT32_MAX = 2**31 - 1


@dataclass
class SharedScratch:
    """The Triton plan's workspace (kernels/swap/shared_phase.py), allocated once so that the
    plan allocates nothing (CUDA-graph safe); each planning process has its own. Sized for a
    call of every request slot's G k <= B - W entries, E = R (B - W): a claim table [2^ceil
    (log2 2E)] (key int64, -1 empty; owner int32, INT32_MAX empty; the owner's rank in its
    group), empty between calls; `claims` [E] (claim positions by rank, for the cleanup),
    `groups` [R] (owners per group, then their offsets), `victims` [S], `meta` [2] (owners,
    owners given a slot). About 36 bytes per entry: < 0.1% of the hot buffers it serves."""

    claim_key: torch.Tensor
    claim_owner: torch.Tensor
    claim_rank: torch.Tensor
    claims: torch.Tensor
    groups: torch.Tensor
    victims: torch.Tensor
    meta: torch.Tensor

    @classmethod
    def allocate(cls, layout: KVLayout, slots: int, device: torch.device) -> SharedScratch:
        n = scratch_sizes(layout, slots)  # contract.capacity counts the same bytes

        def i32(size: int, fill: int = 0) -> torch.Tensor:
            return torch.full((size,), fill, dtype=torch.int32, device=device)

        return cls(
            claim_key=torch.full((n["claim_table"],), -1, dtype=torch.int64, device=device),
            claim_owner=i32(n["claim_table"], INT32_MAX),
            claim_rank=i32(n["claim_table"]),
            claims=i32(n["claims"]),
            groups=i32(n["groups"]),
            victims=i32(n["victims"]),
            meta=i32(n["meta"]),
        )


def region_specs(layout: KVLayout, slots: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The region's state tensors by exported name (a service shares them with the session that
    plans with them, beside the KV tensors: docs/ARCHITECTURE.md, Memory)."""
    L, R, i32, i64 = layout.num_layers, layout.max_requests, torch.int32, torch.int64
    return {
        "shared_key": ((L, slots), i64),
        "shared_index": ((L, 2 * slots), i32),
        "shared_last": ((L, slots), i64),
        "shared_order": ((L, slots), i32),
        "shared_page_gen": ((layout.num_pages,), i32),
        "shared_len": ((R,), i32),
        "shared_step": ((1,), i64),
    }


@dataclass
class SharedRegion:
    """The region's bookkeeping tensors, on the hot buffers' device."""

    base: int
    key: torch.Tensor  # [L, S] int64
    index: torch.Tensor  # [L, 2S] int32
    last: torch.Tensor  # [L, S] int64
    order: torch.Tensor  # [L, S] int32: the slots by (last, slot), least recently read first
    page_gen: torch.Tensor  # [num_pages] int32
    shared_len: torch.Tensor  # [R] int32
    step: torch.Tensor  # [1] int64: the decode step, counted on the device
    scratch: SharedScratch

    @classmethod
    def allocate(cls, layout: KVLayout, slots: int, device: torch.device) -> SharedRegion:
        """A new, empty region of `slots` slots per layer."""
        check_shared_slots(layout, slots)
        specs = region_specs(layout, slots)
        tensors = {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in specs.items()}
        region = cls.of(layout, slots, tensors, device)
        region.clear()
        return region

    @classmethod
    def of(
        cls, layout: KVLayout, slots: int, tensors: dict[str, torch.Tensor], device: torch.device
    ) -> SharedRegion:
        """The region on its state tensors (allocated here or mapped from a service: as they
        are), with a scratch of this process's own."""
        check_shared_slots(layout, slots)
        for name, (shape, dtype) in region_specs(layout, slots).items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous {shape} {dtype}")
        return cls(
            base=layout.max_requests - slots // layout.hot_slots,
            key=tensors["shared_key"],
            index=tensors["shared_index"],
            last=tensors["shared_last"],
            order=tensors["shared_order"],
            page_gen=tensors["shared_page_gen"],
            shared_len=tensors["shared_len"],
            step=tensors["shared_step"],
            scratch=SharedScratch.allocate(layout, slots, device),
        )

    @property
    def slots(self) -> int:
        return self.key.shape[1]

    def clear(self) -> None:
        """Empty, and no request slot may read from it (a new service or engine)."""
        self.empty()
        self.shared_len.zero_()

    def empty(self) -> None:
        """No slot holds a row, none was ever read (so none is pinned): what a new planner
        starts from, since the one before it may have died between a plan that keyed a slot
        and the copy that was to fill it (kv_service/memory/region_lease.py). Each request
        slot's `shared_len` stays: it is the request's, not the planner's. Synchronous on CUDA:
        the next planner may be another process, or run on another stream."""
        self.key.fill_(-1)
        self.index.fill_(-1)
        self.last.fill_(-1)
        order = torch.arange(self.slots, dtype=torch.int32, device=self.order.device)
        self.order.copy_(order.expand_as(self.order))
        if self.key.device.type == "cuda":
            torch.cuda.current_stream(self.key.device).synchronize()

    def forget_pages(self, pages: list[int]) -> None:
        """Pages back in the free pool: their rows in the region never hit again."""
        if pages:
            idx = torch.tensor(pages, dtype=torch.int64, device=self.page_gen.device)
            self.page_gen.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))

    def next_step(self) -> None:
        """A new decode step: the slots read so far are no longer pinned (a device op, so a
        captured graph counts its replays)."""
        self.step.add_(1)

    def live(self, page_size: int) -> int:
        """Slots, over all layers, holding a row of a page's current generation: rows that can
        still hit (a host sync; for tests and stats)."""
        held = self.key >= 0
        page = torch.where(held, (self.key & 0xFFFFFFFF) // page_size, 0)
        current = (self.key >> 32) == self.page_gen.long()[page]
        return int((held & current).sum())
