"""What a layout costs on the GPU, byte for byte, and how many requests of a workload a GPU KV
budget holds (issue 40, item 2: admission counts what a request really adds).

The service admits a request into one request slot and the pages of its reservation (prompt +
growth), the pages of a cached prefix counted once for all their users (kv_service.books.ledger).
On the GPU a request slot is its private hot buffer (B rows per layer), its residency state and
page-table row; a page is its index keys (every layer). With a shared hot region (S slots per
layer, `KVLayout.shared_slots`) the rows of cached prefix pages are held once, so a request
needs only enough private slots for the rows that are its own: the layout's B is then that
private buffer (at least W + k), not a buffer sized for the whole context. `fit` sizes a layout to
a budget from exactly these counts, and `device_bytes` is what allocation then takes (tested
against the allocated tensors): no estimate sits between the budget and admission.

Torch-free (the engine's and the service's --help import it through their configs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contract.layout import KVLayout


def scratch_sizes(layout: KVLayout, slots: int) -> dict[str, int]:
    """Elements of each tensor of the Triton plan's shared-phase workspace
    (contract.shared_region.SharedScratch): a call plans at most E = R (B - W) entries, as
    the plan needs G k <= B - W; with host reads k may pass B - W, and E = R max(B - W, k)
    (a speculative union past both is refused: KVLayout.check_draft_tokens)."""
    per_request = layout.lru_slots
    if layout.host_reads:
        per_request = max(per_request, layout.topk)
    entries = layout.max_requests * per_request
    return {
        "claim_table": 1 << (2 * entries - 1).bit_length(),
        "claims": entries,
        "groups": layout.max_requests,
        "victims": slots,
        "meta": 2,
    }


def region_bytes(layout: KVLayout) -> int:
    """Device bytes of the shared region's state and of one planner's workspace; its hot rows
    are request slots' buffers, counted with them."""
    S, L = layout.shared_slots, layout.num_layers
    if not S:
        return 0
    # key int64, index 2 x int32, last int64, order int32 per (layer, slot); page_gen, shared_len
    # and the step counter.
    state = 28 * L * S + 4 * layout.num_pages + 4 * layout.max_requests + 8
    sc = scratch_sizes(layout, S)
    # claim key int64, owner and rank int32 per claim table entry; the rest int32.
    return state + 16 * sc["claim_table"] + 4 * (sc["claims"] + sc["groups"] + sc["victims"] + 2)


def device_bytes(layout: KVLayout) -> int:
    """Every byte the layout's tensors take on the GPU (all but the host tier)."""
    lay = layout
    L, R, B = lay.num_layers, lay.max_requests, lay.hot_slots
    hot = L * R * B * lay.row_bytes
    index_pool = L * lay.num_pages * lay.page_size * lay.index_bytes
    residency = 4 * L * R * (lay.max_context + B + lay.lru_slots)
    per_slot = 4 * lay.max_pages_per_request + 4 + B  # page-table row, mode, hit flags
    return hot + index_pool + residency + R * per_slot + region_bytes(lay)


@dataclass(frozen=True)
class Workload:
    """Requests that each reserve `context` tokens (prompt + growth), of which the first
    `shared` (whole pages; 0: none) are a prefix common to all of them, cached once."""

    context: int
    shared: int = 0

    def pages(self, layout: KVLayout, requests: int) -> int:
        """Pages `requests` such requests hold at once: private pages each, the prefix once."""
        per_request, common = layout.pages_for(self.context), self.shared // layout.page_size
        if self.shared % layout.page_size or self.shared >= self.context:
            raise ValueError(f"shared prefix {self.shared}: whole pages below {self.context}")
        return requests * (per_request - common) + common if requests else 0


def sized(template: KVLayout, work: Workload, requests: int) -> KVLayout:
    """`template` with room for `requests` of `work`: their request slots beside the region's,
    and their pages."""
    region = template.shared_slots // template.hot_slots
    return dataclasses.replace(
        template, max_requests=requests + region, num_pages=work.pages(template, requests)
    )


def fit(template: KVLayout, work: Workload, budget: int) -> KVLayout:
    """The layout of the most requests of `work` whose device bytes fit `budget` (the template
    gives every other size); ValueError if not even one fits."""
    if device_bytes(sized(template, work, 1)) > budget:
        raise ValueError(f"a GPU budget of {budget} B holds no request of {work}")
    low, high = 1, 2
    while device_bytes(sized(template, work, high)) <= budget:
        low, high = high, 2 * high
    while high - low > 1:  # device_bytes grows with the requests: bisect
        mid = (low + high) // 2
        low, high = (
            (mid, high) if device_bytes(sized(template, work, mid)) <= budget else (low, mid)
        )
    return sized(template, work, low)
