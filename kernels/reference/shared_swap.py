"""Reference of the swap plan's shared phase (issue 40): hot rows of cached, read-only prefix
pages live once per layer in a shared region of S slots, whichever requests select them.

Per layer the region is kept in four tensors (contract/shared_region.py allocates them):
- `key` [L, S] int64: the row each slot holds, `page_gen[page] << 32 | page * P + offset`,
  or -1. The generation makes a freed (and later reused) page's old rows never hit again;
- `index` [L, 2S] int32: an open-addressing table (linear probing, back-shift deletion) from a
  key to its slot, -1 empty; a table entry is a slot, whose `key` says which row it is;
- `last` [L, S] int64: the step that last read the slot (-1: never). A slot read at the current
  step (`step[0]`) is pinned: no plan call of this step evicts it, so no request loses a row
  another request of the same step reads, across micro-batches too;
- `order` [L, S] int32: the slots sorted by (last, slot), least recently read first: derived
  from `last` here, kept up to date in O(S) by the Triton plan, which takes its victims there;
- `shared_len` [R] int32: positions below it (a request's cached prefix) are shared rows.

Eligible entries of a (layer, request) are the valid positions below shared_len, outside the
window ring and not privately resident (token_slot < 0). Taken over the call's requests in
batch order, each eligible entry either hits the table (its slot is pinned), repeats a key
missed earlier in the call (it reads that miss's slot), or misses. Victims are the unpinned
slots, least recently read first, ties to the lower slot id; the first occurrence of a missed
key gets the next victim and its request copies the row. Misses beyond the unpinned slots
spill: the private plan then serves them like any private row. A shared slot s of request slot
r is written in the slot list relative to r's hot buffer: (base - r) * B + s, where `base` is
the first request slot whose buffer the region occupies, so attention does not change.
"""

from __future__ import annotations

from kernels.formats import MODE_OFFLOADED

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1  # Knuth's multiplicative hash constant (32 bits)


def row_key(gen: int, row: int) -> int:
    return (gen << 32) | row


def table_home(key: int, size: int) -> int:
    """The probe start of a key: a 32x32-bit multiplicative hash (same low bits in int64)."""
    return (((key & MASK32) ^ (key >> 32)) * GOLDEN & MASK32) % size


class SharedTable:
    """One layer's region as Python lists; `store` writes them back."""

    def __init__(self, shared, layer: int) -> None:
        self.shared, self.layer = shared, layer
        self.key = shared.key[layer].tolist()
        self.index = shared.index[layer].tolist()
        self.last = shared.last[layer].tolist()

    def lookup(self, key: int) -> int:
        T = len(self.index)
        i = table_home(key, T)
        while self.index[i] >= 0:
            if self.key[self.index[i]] == key:
                return self.index[i]
            i = (i + 1) % T
        return -1

    def remove(self, slot: int) -> None:
        """Drop `slot`'s entry, then shift back later entries of its probe run (no tombstones,
        so a lookup always stops at the first empty entry)."""
        T = len(self.index)
        i = table_home(self.key[slot], T)
        while self.index[i] != slot:
            i = (i + 1) % T
        self.index[i], j = -1, i
        while True:
            j = (j + 1) % T
            s = self.index[j]
            if s < 0:
                return
            home = table_home(self.key[s], T)
            # s may move to the hole at i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and i >= home > j):
                self.index[i], self.index[j], i = s, -1, j

    def insert(self, slot: int, key: int) -> None:
        T = len(self.index)
        i = table_home(key, T)
        while self.index[i] >= 0:
            i = (i + 1) % T
        self.index[i], self.key[slot] = slot, key

    def victims(self, step: int, m: int) -> list[int]:
        """The m least recently read unpinned slots (fewer if fewer are unpinned)."""
        free = sorted((t, s) for s, t in enumerate(self.last) if t != step)
        return [s for _, s in free[:m]]

    def store(self) -> None:
        sh, l = self.shared, self.layer
        self.order = sorted(range(len(self.last)), key=lambda s: (self.last[s], s))
        for name in ("key", "index", "last", "order"):
            dst = getattr(sh, name)[l]
            dst.copy_(dst.new_tensor(getattr(self, name)))


def ref_shared_plan(layer, groups, shared):
    """Serve the eligible entries of every group of one plan call from the shared region.

    groups: per group (a request's rows) in batch order, the key of each entry, or None where
    the entry is not eligible. Returns per group: the shared slot of each entry or -1, the
    copies it does [(entry index, shared slot)] and the indices of its entries that spilled."""
    table, step = SharedTable(shared, layer), int(shared.step[0])
    slots = [[-1] * len(keys) for keys in groups]
    claims: dict[int, list[tuple[int, int]]] = {}
    for g, keys in enumerate(groups):
        for i, key in enumerate(keys):
            if key is None:
                continue
            s = table.lookup(key)
            if s >= 0:
                slots[g][i], table.last[s] = s, step
            else:
                claims.setdefault(key, []).append((g, i))
    order = list(claims)  # first occurrences, in batch order (dicts keep insertion order)
    victims = table.victims(step, len(order))
    copies: list[list[tuple[int, int]]] = [[] for _ in groups]
    spilled: list[list[int]] = [[] for _ in groups]
    for key, v in zip(order, victims):
        if table.key[v] >= 0:
            table.remove(v)
        table.insert(v, key)
        table.last[v] = step
        g0, i0 = claims[key][0]
        copies[g0].append((i0, v))
        for g, i in claims[key]:
            slots[g][i] = v
    for key in order[len(victims) :]:
        for g, i in claims[key]:
            spilled[g].append(i)
    table.store()
    return slots, copies, spilled


def shared_phase(layer, groups, shared, token_slot, page_table, P, W):
    """The shared region's part of one plan call over groups [(request slot, mode, row
    lengths, [(position, its row's length)])]: per group, the shared slot of each entry (-1:
    the private plan serves it) and the copies [(entry index, shared slot)] it does."""
    if shared is None:
        return [([-1] * len(entries), []) for *_, entries in groups]
    gens = shared.page_gen.tolist()
    keys: list[list[int | None]] = []
    for r, mode, row_lens, entries in groups:
        keys.append([None] * len(entries))
        if mode != MODE_OFFLOADED:
            continue
        ts, pages = token_slot[layer, r].tolist(), page_table[r].tolist()
        below = min(int(shared.shared_len[r]), max(row_lens) - W)
        for i, (t, n) in enumerate(entries):
            if 0 <= t < min(n, below) and ts[t] < 0 and pages[t // P] >= 0:
                page = pages[t // P]
                keys[-1][i] = row_key(gens[page], page * P + t % P)
    slots, copies, _ = ref_shared_plan(layer, keys, shared)
    return list(zip(slots, copies))


def shared_copies(layer, r, shared, entries, slots, served, pages, dims):
    """Write the group's shared slots into its slot list `slots` (relative to request slot r's
    hot buffer) and return its copies [(flat host row, flat hot row)]; dims = (L, R, B, P)."""
    if shared is None:
        return []
    L, R, B, P = dims
    base = shared.base
    for i, s in enumerate(served[0]):
        if s >= 0:
            slots[i] = (base - r) * B + s
    out = []
    for i, s in served[1]:
        t = entries[i][0]
        out.append(((pages[t // P] * L + layer) * P + t % P, (layer * R + base) * B + s))
    return out
