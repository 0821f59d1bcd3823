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

Embedded mode only for now (`LocalLayout.shared_slots`): the tensors are not exported to a
service's engines yet (docs/DECISIONS.md, Prefix sharing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contract.layout import KVLayout, check_shared_slots


@dataclass
class SharedRegion:
    """The region's bookkeeping tensors, on the hot buffers' device."""

    base: int
    key: torch.Tensor  # [L, S] int64
    index: torch.Tensor  # [L, 2S] int32
    last: torch.Tensor  # [L, S] int64
    page_gen: torch.Tensor  # [num_pages] int32
    shared_len: torch.Tensor  # [R] int32
    step: torch.Tensor  # [1] int64: the decode step, counted on the device

    @classmethod
    def allocate(cls, layout: KVLayout, slots: int, device: torch.device) -> SharedRegion:
        check_shared_slots(layout, slots)
        L, R = layout.num_layers, layout.max_requests
        region = cls(
            base=R - slots // layout.hot_slots,
            key=torch.empty((L, slots), dtype=torch.int64, device=device),
            index=torch.empty((L, 2 * slots), dtype=torch.int32, device=device),
            last=torch.empty((L, slots), dtype=torch.int64, device=device),
            page_gen=torch.zeros((layout.num_pages,), dtype=torch.int32, device=device),
            shared_len=torch.zeros((R,), dtype=torch.int32, device=device),
            step=torch.zeros((1,), dtype=torch.int64, device=device),
        )
        region.clear()
        return region

    @property
    def slots(self) -> int:
        return self.key.shape[1]

    def clear(self) -> None:
        """Empty: no slot holds a row, none was ever read."""
        self.key.fill_(-1)
        self.index.fill_(-1)
        self.last.fill_(-1)
        self.shared_len.zero_()

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
