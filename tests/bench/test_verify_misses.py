"""bench.shared.verify_misses: plain decoding (D = 0) is the trace's own LRU miss rate times k
per token; with every draft accepted, a verify step of D + 1 rows emits D + 1 tokens and copies
the union of their new rows; an LRU too small for a union is refused, not truncated."""

from __future__ import annotations

import numpy as np
import pytest

from bench.shared.trace import TraceParams, lru_update, simulate
from bench.shared.verify_misses import misses_per_token

K, CONTEXT, WINDOW = 256, 4096, 16


def test_plain_decoding_is_the_traces_miss_rate_per_selected_row() -> None:
    plain = misses_per_token(2 * K, 0, (0.9,), K, CONTEXT, WINDOW, steps=60, warmup=20)
    # simulate() starts one position earlier: the same steps once it has run one more.
    rate = simulate(TraceParams(), K, CONTEXT + 1, WINDOW, (2,), steps=60, warmup=20)[2]
    assert plain == pytest.approx(rate * K)


def test_every_draft_accepted_emits_d_plus_one_tokens_a_step() -> None:
    one = misses_per_token(4 * K, 1, (1.0,), K, CONTEXT, WINDOW, steps=40, warmup=10)
    none = misses_per_token(4 * K, 1, (0.0,), K, CONTEXT, WINDOW, steps=40, warmup=10)
    # Rate 0 emits one token a step and copies two rows' union; rate 1 emits two for the same
    # kind of step, advancing twice as fast through the trace.
    assert 0 < one < none


def test_a_union_larger_than_the_lru_is_refused() -> None:
    order = np.full(4, -1, dtype=np.int64)
    order, misses = lru_update(order, np.array([1, 2, 3]))
    assert misses == 3 and sorted(order[1:].tolist()) == [1, 2, 3]
    order, misses = lru_update(order, np.array([2, 7]))  # one hit, one miss: -1 is the victim
    assert misses == 1 and -1 not in order.tolist()
    with pytest.raises(ValueError, match="too small"):
        lru_update(order, np.array([2, 20, 21, 22, 23]))  # four misses, three victims
