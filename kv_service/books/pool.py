"""Plain-Python allocators of the service's pools: pages and request slots (kv_service.books.ledger
uses them, with the prefix cache).

A page id addresses the same page in the host tier and in the index-key pool, so one PagePool
serves both. Both pools hand out the lowest free ids first, so runs are reproducible.
Invariants are asserted after every change; they are cheap (set sizes).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from contract.errors import CapacityError


class _IdPool:
    """Ids 0..total-1, lowest free first."""

    unit = "ids"

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"{self.unit} pool size must be positive, got {total}")
        self.total = total
        self._free = list(range(total))
        self._used: set[int] = set()

    @property
    def used(self) -> int:
        return len(self._used)

    @property
    def free(self) -> int:
        return self.total - len(self._used)

    def take(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot take {n} {self.unit}")
        if n > self.free:
            raise CapacityError(
                f"{n} {self.unit} needed, {self.free} free of {self.total}",
                {
                    f"{self.unit}_needed": n,
                    f"{self.unit}_free": self.free,
                    f"{self.unit}_total": self.total,
                },
            )
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        self._check()
        return ids

    def give_back(self, ids: list[int]) -> None:
        foreign = [i for i in ids if i not in self._used]
        if foreign or len(set(ids)) != len(ids):
            raise ValueError(f"{self.unit} not in use or repeated: {sorted(foreign) or ids}")
        self._used.difference_update(ids)
        for i in ids:
            heapq.heappush(self._free, i)
        self._check()

    def _check(self) -> None:
        assert len(self._free) + len(self._used) == self.total, "pool lost or duplicated ids"

    def is_empty(self) -> bool:
        """True when everything is free again, checked element by element."""
        return not self._used and sorted(self._free) == list(range(self.total))


class PagePool(_IdPool):
    """Pages of the host tier (and of the index-key pool, which has the same page ids).
    on_free hears of pages given back (the shared hot region forgets their rows)."""

    unit = "pages"

    def __init__(self, total: int, on_free: Callable[[list[int]], None] | None = None) -> None:
        super().__init__(total)
        self.on_free = on_free

    def give_back(self, ids: list[int]) -> None:
        super().give_back(ids)
        if self.on_free is not None:
            self.on_free(ids)


class SlotPool(_IdPool):
    """Request slots: rows of page_table, req_mode and the hot buffers."""

    unit = "slots"

    def take_one(self) -> int:
        return self.take(1)[0]
