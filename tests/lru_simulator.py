"""Exact-LRU model of one (layer, request) of an offloaded request, in plain Python.

Written independently of the plan kernel: instead of partitioning an order it keeps a recency
key per LRU slot and sorts. Slots touched at a step are newer than untouched ones; among them the
hit slots keep their old relative recency and the newly filled victims are newest, in miss order.
"""

from __future__ import annotations


class LRUSim:
    """Hot slots [0, W) are the window ring; slots [W, B) are managed by exact LRU."""

    def __init__(self, hot_slots: int, window: int) -> None:
        self.B, self.W = hot_slots, window
        # Smaller key = less recently used. Initially slot W is the least recent.
        self.key = {s: s for s in range(window, hot_slots)}
        self.holds: dict[int, int] = {}  # slot -> token
        self.where: dict[int, int] = {}  # token -> slot

    def order(self) -> list[int]:
        """LRU slots, least recently used first."""
        return sorted(self.key, key=self.key.__getitem__)

    def step(self, topk: list[int], seq_len: int, host_row=None):
        """Serve one top-k selection.

        Returns (slots, misses, evicted): the hot slot of each entry (-1 for bad positions),
        [(entry index, token, victim slot)] in top-k order, and the tokens evicted. A position
        may repeat: its first occurrence is the miss, the repeats get the same slot.
        host_row (t -> flat host row; the plan's host fallback): misses past the evictable
        slots take no victim and read their host row, every entry of them -2 - host_row(t).
        """
        slots: list[int] = []
        hit_slots: set[int] = set()
        missed: list[int] = []
        first: dict[int, int] = {}  # missed token -> its first entry
        for i, t in enumerate(topk):
            if not 0 <= t < seq_len:
                slots.append(-1)
            elif t >= seq_len - self.W:
                slots.append(t % self.W)
            elif t in self.where:
                slots.append(self.where[t])
                hit_slots.add(self.where[t])
            else:
                slots.append(-1)
                if t not in first:
                    first[t] = i
                    missed.append(i)
        untouched = [s for s in self.order() if s not in hit_slots]
        victims = untouched[: len(missed)]
        assert host_row is not None or len(victims) == len(missed), (
            "more misses than evictable slots"
        )
        new_key = {s: (0, self.key[s]) for s in self.key}
        for s in hit_slots:
            new_key[s] = (1, self.key[s])
        for j, v in enumerate(victims):
            new_key[v] = (2, j)
        ranked = sorted(new_key, key=new_key.__getitem__)
        self.key = {s: rank for rank, s in enumerate(ranked)}
        evicted, misses = [], []
        for i, v in zip(missed, victims):
            if v in self.holds:
                evicted.append(self.holds[v])
                del self.where[self.holds[v]]
            t = topk[i]
            self.holds[v], self.where[t] = t, v
            slots[i] = v
            misses.append((i, t, v))
        slots = [
            (self.where[t] if t in self.where else -2 - host_row(t)) if t in first else s
            for t, s in zip(topk, slots)
        ]
        return slots, misses, evicted

    def step_union(self, rows: list[list[int]], row_lens: list[int], host_row=None):
        """Serve the rows of one speculative step together: one LRU step over the union of
        their valid positions (each row's own length decides validity, the longest row's the
        window), in first-occurrence order, row by row.

        Returns (per-row slots, misses of the union as in `step`, evicted tokens, and the
        misses summed over the rows: what planning each row alone on the old state would
        copy)."""
        union: list[int] = []
        for row, n in zip(rows, row_lens):
            union += [t for t in row if 0 <= t < n and t not in union]
        seq_len = max(row_lens)
        old = seq_len - self.W
        row_misses = sum(
            1
            for row, n in zip(rows, row_lens)
            for t in row
            if 0 <= t < min(n, old) and t not in self.where
        )
        slots, misses, evicted = self.step(union, seq_len, host_row)
        slot_of = dict(zip(union, slots))
        per_row = [
            [slot_of[t] if 0 <= t < n else -1 for t in row] for row, n in zip(rows, row_lens)
        ]
        return per_row, misses, evicted, row_misses


def check_bijection(
    slot_token: list[int], token_slot: list[int], lru_order: list[int], window: int
) -> None:
    """The residency invariant of one (layer, request): lru_order is a permutation of the LRU
    slots [W, B), and resident tokens and LRU slots map one to one (slot_token[s] = t exactly
    when token_slot[t] = s). Duplicate positions in a top-k row used to break it."""
    B = len(slot_token)
    assert sorted(lru_order) == list(range(window, B)), "lru_order is not a permutation"
    held = {s: t for s, t in enumerate(slot_token) if s >= window and t >= 0}
    placed = {t: s for t, s in enumerate(token_slot) if s >= 0}
    assert all(0 <= t < len(token_slot) for t in held.values()), "slot holds a bad token"
    assert {t: s for s, t in held.items()} == placed, "slot_token and token_slot disagree"
    assert len(set(held.values())) == len(held), "two slots hold one token"


class SharedLRUSim:
    """Exact LRU of one layer's shared region (issue 40), in plain Python: rows of cached
    pages, keyed by any hashable row id, live in slots [0, S). Independently of the reference's
    tensors and hash table: a dict of rows and a last-read step per slot. A slot read at the
    current step is pinned; victims are the unpinned slots, least recently read first (never
    read before anything), ties to the lower slot. A freed page's rows are new row ids once the
    page is reused (the caller names rows with the page's generation), so nothing is forgotten
    here: stale rows just stop being asked for."""

    def __init__(self, slots: int) -> None:
        self.S = slots
        self.last: dict[int, int] = {}  # slot -> step that last read it
        self.holds: dict[int, object] = {}  # slot -> row
        self.where: dict[object, int] = {}  # row -> slot

    def step(self, rows: list, now: int):
        """Serve rows (None: not a shared row) read at step `now`, in order. Returns (slot of
        each row or -1, [(index, row, slot)] of the first occurrence of each missed row that
        got a slot, the indices that spilled)."""
        slots = [-1] * len(rows)
        missed: dict[object, list[int]] = {}
        for i, row in enumerate(rows):
            if row is None:
                continue
            if row in self.where:
                slots[i] = self.where[row]
                self.last[slots[i]] = now
            else:
                missed.setdefault(row, []).append(i)
        unpinned = [s for s in range(self.S) if self.last.get(s) != now]
        unpinned.sort(key=lambda s: (self.last.get(s, -1), s))
        copies, spilled = [], []
        for j, (row, idx) in enumerate(missed.items()):
            if j >= len(unpinned):
                spilled += idx
                continue
            v = unpinned[j]
            old = self.holds.get(v)
            if old is not None and self.where.get(old) == v:
                del self.where[old]
            self.holds[v], self.where[row], self.last[v] = row, v, now
            copies.append((idx[0], row, v))
            for i in idx:
                slots[i] = v
        return slots, copies, spilled
