"""Content-addressed full pages shared between requests (prefix caching), in plain Python.

Every page of the pool is in exactly one of three states:
- free: in the PagePool;
- in use: referenced by admitted requests (`refs(page) > 0`); private to one request, or cached
  (indexed by its key) and then readable by any number of them;
- cached and unreferenced: kept for a later request, evictable, in LRU order.
A key is a page name scoped by its namespace (`contract.prefix`). A page is published (cached)
only once its rows are written; cached pages are never written again, only read. The last,
partial page of a request is never published: only full pages have names.

Admission takes the cached pages of a prompt's prefix and fresh private pages in one step, and
evicts unreferenced cached pages (least recently used first) before it refuses for capacity.
A page in use is never evicted. Invariants are asserted after every change (cheap: sizes);
`check()` verifies them element by element (tests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from contract.errors import CapacityError
from kv_service.books.pool import PagePool


class PrefixCache:
    """Reference counts and the key index of the pages of one PagePool."""

    def __init__(self, pages: PagePool) -> None:
        self.pages = pages
        self._index: dict[bytes, int] = {}  # key -> cached page
        self._key: dict[int, bytes] = {}  # cached page -> key
        self._refs: dict[int, int] = {}  # page in use -> references (> 0)
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached, oldest first
        self.evicted_total = 0

    # --- queries ---

    @property
    def cached(self) -> int:
        """Pages holding a published key (in use or not)."""
        return len(self._key)

    @property
    def evictable(self) -> int:
        """Cached pages no request references."""
        return len(self._lru)

    @property
    def in_use(self) -> int:
        return len(self._refs)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        return page in self._key

    def room(self, hits: Sequence[int]) -> int:
        """Fresh pages an admission reusing `hits` could take: free plus evictable ones."""
        return self.pages.free + self.evictable - sum(p in self._lru for p in set(hits))

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys` (no reference taken)."""
        found = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                break
            found.append(page)
        return found

    # --- changes ---

    def take(self, hits: Sequence[int], fresh: int) -> list[int]:
        """Reference the cached pages `hits` and `fresh` new private pages, evicting unreferenced
        cached pages (not among `hits`) as needed. All or nothing: a CapacityError changes
        nothing. Returns the new pages."""
        if fresh < 0:
            raise ValueError(f"cannot take {fresh} pages")
        unknown = [p for p in hits if p not in self._key]
        if unknown:
            raise ValueError(f"pages {unknown} are not cached")
        spare = self.room(hits) - self.pages.free
        if fresh > self.pages.free + spare:
            raise CapacityError(
                f"{fresh} pages needed, {self.pages.free} free and {spare} evictable cached "
                f"of {self.pages.total}",
                pages_needed=fresh,
                pages_free=self.pages.free,
                pages_evictable=spare,
                pages_total=self.pages.total,
            )
        for page in hits:
            self._lru.pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1
        self._evict(fresh - self.pages.free)
        new = self.pages.take(fresh)
        self._refs.update((page, 1) for page in new)
        self._assert_sizes()
        return new

    def publish(self, page: int, key: bytes) -> bool:
        """Index the written page `page` (in use) under `key`. False, and no change, when
        another page holds the key already or the page is cached under another key."""
        if page not in self._refs:
            raise ValueError(f"page {page} is not in use")
        if key in self._index or page in self._key:
            return False
        self._index[key], self._key[page] = page, key
        self._assert_sizes()
        return True

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page. Private pages go back to the pool, cached ones to
        the LRU tail. Later pages of a request become unreferenced first (the list is walked
        backwards), so a chain is evicted from its end and its prefix stays usable longest."""
        counts: dict[int, int] = {}
        for page in pages:
            counts[page] = counts.get(page, 0) + 1
        short = [p for p, n in counts.items() if self._refs.get(p, 0) < n]
        if short:
            raise ValueError(f"pages {sorted(short)} are not referenced")
        freed = []
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._key:
                self._lru[page] = None
            else:
                freed.append(page)
        self.pages.give_back(freed)
        self._assert_sizes()

    def flush(self) -> int:
        """Forget every key. Unreferenced cached pages are freed (their count is returned);
        cached pages in use become private to their requests and are freed with them."""
        freed = list(self._lru)
        self._lru.clear()
        self._index.clear()
        self._key.clear()
        self.pages.give_back(freed)
        self._assert_sizes()
        return len(freed)

    def _evict(self, n: int) -> None:
        victims: list[int] = []
        for page in self._lru:
            if len(victims) >= n:
                break
            victims.append(page)
        for page in victims:
            del self._lru[page]
            del self._index[self._key.pop(page)]
        self.evicted_total += len(victims)
        self.pages.give_back(victims)

    # --- invariants ---

    def _assert_sizes(self) -> None:
        assert len(self._index) == len(self._key), "key index and page keys disagree"
        assert len(self._refs) + len(self._lru) == self.pages.used, "a page leaked or is lost"

    def check(self, held: Iterable[Sequence[int]] | None = None) -> None:
        """Every invariant, element by element. `held`: the page lists of every admitted
        request; then each reference count must equal the number of its holders."""
        self._assert_sizes()
        assert all(self._index[k] == p for p, k in self._key.items()), "index not inverse"
        assert not set(self._lru) & set(self._refs), "an unreferenced page is also in use"
        assert all(p in self._key for p in self._lru), "an uncached page waits for eviction"
        assert all(n > 0 for n in self._refs.values()), "a zero reference count"
        if held is None:
            return
        counts: dict[int, int] = {}
        for pages in held:
            for page in pages:
                counts[page] = counts.get(page, 0) + 1
        assert counts == self._refs, "reference counts differ from the holders"
