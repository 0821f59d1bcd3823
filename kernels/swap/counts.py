"""The select bookkeeping, added by each program of the swap plan (kernels/swap/plan.py): the plan
knows each entry's fate, so counting there costs a few integer atomics per request instead of
separate reductions and index-adds per layer (issue 38 item 1). Integer adds: the sums are exact
and do not depend on the order the programs run in."""

from __future__ import annotations

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import triton
import triton.language as tl


@triton.jit
def add_totals(totals_ptr, sel, m):
    """(selected, misses) of the whole batch: integer atomics, so the sums are exact and their
    order does not matter."""
    n = tl.sum(sel.to(tl.int64), 0)
    tl.atomic_add(totals_ptr, n, mask=n != 0, sem="relaxed")
    tl.atomic_add(totals_ptr + 1, m.to(tl.int64), mask=m != 0, sem="relaxed")


@triton.jit
def add_counts(counts_ptr, req_slots_ptr, b, sel, i, k, m, row_misses, R, G: tl.constexpr):
    """(selected, misses, misses summed over rows) per request slot, row R for padding rows
    (req_slot outside [0, R)): each row's selected entries at its own slot, the copies at the
    request's (its first row's)."""
    for g in tl.static_range(G):
        rg = tl.load(req_slots_ptr + b * G + g)
        row = tl.where((rg >= 0) & (rg < R), rg, R).to(tl.int64)
        n = tl.sum((sel & (i // k == g)).to(tl.int64), 0)
        tl.atomic_add(counts_ptr + row * 3, n, mask=n != 0, sem="relaxed")
        if g == 0:
            tl.atomic_add(counts_ptr + row * 3 + 1, m.to(tl.int64), mask=m != 0, sem="relaxed")
            tl.atomic_add(
                counts_ptr + row * 3 + 2,
                row_misses.to(tl.int64),
                mask=row_misses != 0,
                sem="relaxed",
            )
