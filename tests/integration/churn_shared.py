"""The churn with shared prefixes (tests/integration/test_shared_churn.py): prompts start with one
of two common prefixes, the shared hot region is on (the embedded engine's, or the service's),
and `SharedWatch` adds its checks to the churn's (tests/integration/churn.py).

Every finished step (event loop; no step's host work races it):
- the in-process books (embedded, baseline: the ServiceCore) hold every invariant
  (`ServiceCore.check`: reference counts equal the page tables' holders, cached pages unused
  or in use, none leaked);
- each request slot's `shared_len` is its request's cached prefix if offloaded, else 0 (CPU);
- the service modes: the service's region rows are read (GetStats), to see it was used.
Every decode layer, right after its swap-in (CPU only: on CUDA these reads would sync inside a
captured graph), in every mode with a hot buffer:
- every selected position's slot holds that position's row, byte for byte (private slots,
  window ring and region slots alike; offloaded requests, whose host rows are the truth);
- the region (where this process maps it) has unique keys, an index that finds each key at its
  slot and nothing else, `order` sorted by (last read, slot), and each live slot holds its row.
At the end: the books hold only cached pages, sharing happened (prefix hits; region rows in the
modes that have a region), a Flush empties the pools and the region, and in the service modes
the engine's detach leaves no session and no region row."""

from __future__ import annotations

import dataclasses

import torch

from contract.layout import MODE_OFFLOADED
from kernels.reference.shared_swap import SharedTable
from tests.integration.churn import Churn
from tests.process_harness import LOCAL, flush, holds_only_cache, service_stats

# Two prefixes of 3 pages (P = 8, the prefill chunk 8 too: 24 tokens are reusable); prompts
# reach 8 tokens past the hot slots as in the plain churn, so most are offloaded.
PREFIXES = tuple(tuple((31 * k + 7 * i) % 250 + 1 for i in range(24)) for k in range(2))
MASK32 = 0xFFFFFFFF


class SharedWatch:
    def __init__(self, engine, svc) -> None:
        self.engine, self.svc = engine, svc
        backend = engine.compute.backend
        self.kv = getattr(backend, "kv", None)  # None: the baseline (no hot buffer)
        self.core = getattr(engine.control, "core", None)  # in-process books
        self.wrong: list[str] = []
        self.rows = self.region_rows = 0  # rows checked; most live region rows seen
        if self.kv is not None and self.kv.device.type == "cpu":
            real = backend.select

            def select(layer, topk, req_slots, seq_lens, row0=0, rows_per_request=1):
                out = real(layer, topk, req_slots, seq_lens, row0, rows_per_request)
                self._check_rows(layer, topk, req_slots, seq_lens, out)
                try:  # in the compute thread: reported by step(), not as a failed step
                    self._check_region(layer)
                except AssertionError as e:
                    self.wrong.append(f"layer {layer}: {e}")
                return out

            backend.select = select

    def step(self) -> None:
        assert not self.wrong, self.wrong[:5]
        if self.core is not None:
            self.core.check()
            if self.kv is not None and self.kv.shared is not None and self.kv.device.type == "cpu":
                self._check_shared_len()  # on CUDA a read beside the compute thread's graphs
        if self.svc is not None:
            self.region_rows = max(self.region_rows, service_stats(self.svc).shared_rows)

    def _check_shared_len(self) -> None:
        want = [0] * self.kv.layout.max_requests
        for session in self.core.table.sessions.values():
            for r in session.requests.values():
                want[r.slot] = r.cached_tokens if r.mode == MODE_OFFLOADED else 0
        assert self.kv.shared.shared_len.tolist() == want

    def _check_rows(self, layer, topk, req_slots, seq_lens, out) -> None:
        kv, lay = self.kv, self.kv.layout
        B, P = lay.hot_slots, lay.page_size
        hot = kv.hot_kv[layer].reshape(lay.max_requests * B, lay.row_bytes)
        for i, (r, n) in enumerate(zip(req_slots.tolist(), seq_lens.tolist())):
            if r < 0 or int(kv.req_mode[r]) != MODE_OFFLOADED:
                continue
            for t, s in zip(topk[i].tolist(), out.slots[i].tolist()):
                if not 0 <= t < n:
                    continue
                page = int(kv.page_table[r, t // P])
                self.rows += 1
                if s < 0 or not torch.equal(hot[r * B + s], kv.host_kv[page, layer, t % P]):
                    self.wrong.append(f"layer {layer} slot {r} position {t}: slot {s}")

    def _check_region(self, layer: int) -> None:
        region = self.kv.shared if self.kv is not None else None
        if region is None:
            return
        table, S, B = SharedTable(region, layer), region.slots, self.kv.layout.hot_slots
        held = {s: k for s, k in enumerate(table.key) if k >= 0}
        assert len(set(held.values())) == len(held), "a row in two region slots"
        assert sorted(s for s in table.index if s >= 0) == sorted(held), "index has other slots"
        assert all(table.lookup(k) == s for s, k in held.items()), "index misses a key"
        order = sorted(range(S), key=lambda s: (table.last[s], s))
        assert region.order[layer].tolist() == order, "order not by (last read, slot)"
        gens, live, P = region.page_gen.tolist(), 0, self.kv.layout.page_size
        for s, k in held.items():
            page, off = divmod(k & MASK32, P)
            if k >> 32 != gens[page]:
                continue  # its page was freed: never hits again
            live += 1
            row = self.kv.hot_kv[layer, region.base + s // B, s % B]
            assert torch.equal(row, self.kv.host_kv[page, layer, off]), f"region slot {s}"
        self.region_rows = max(self.region_rows, live)

    async def end(self) -> None:
        """Every request ended, the engine still up."""
        self.step()
        has_region = self.kv is not None and (self.kv.shared is not None or self.svc is not None)
        if self.kv is not None and self.kv.shared is not None:  # the engine's own region
            live = self.kv.shared.live(self.kv.layout.page_size)  # before the Flush
            self.region_rows = max(self.region_rows, live)
        if self.core is not None:
            assert self.core.holds_only_cache()
            assert self.core.stats().prefix_hit_tokens_total > 0
            self.core.flush()
            assert self.core.is_empty()
            if self.kv is not None and self.kv.shared is not None:
                assert self.kv.shared.live(self.kv.layout.page_size) == 0
        if self.svc is not None:
            s = service_stats(self.svc)
            assert holds_only_cache(s) and s.prefix_hit_tokens_total > 0, s
            flush(self.svc)
            s = service_stats(self.svc)
            assert s.host_pages.used == 0 and s.shared_rows == 0, s
        assert not has_region or self.region_rows > 0, "no row went through the region"
        assert self.kv is None or self.kv.device.type != "cpu" or self.rows > 0

    def after(self) -> None:
        """The engine stopped (its session detached)."""
        if self.svc is not None:
            s = service_stats(self.svc)
            assert s.sessions == 0 and s.requests == 0 and s.shared_rows == 0, s


SHARED_CHURN = Churn(
    local=dataclasses.replace(LOCAL, shared_slots=LOCAL.hot_slots),  # 3 request slots left
    prefixes=PREFIXES,
    watch=SharedWatch,
)
