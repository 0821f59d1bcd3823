"""The queue policies on their own (engine_client.loop.queue_policy): what FIFO and skip-ahead
let pass a head refused for capacity. tests/engine_client/loop/test_engine_queue.py runs them in
the engine."""

from __future__ import annotations

import pytest

from engine_client.loop.queue_policy import Fifo, SkipAhead, Turn, queue_policy
from engine_client.loop.request import GenRequest, SamplingParams


def request(name: str, tokens: int) -> GenRequest:
    return GenRequest(name, tuple(range(1, tokens)), 1, SamplingParams())


HEAD, SMALL, SAME, BIG = request("head", 40), request("s", 10), request("eq", 40), request("b", 90)


def test_fifo_lets_nothing_pass_a_refused_head() -> None:
    for req in (SMALL, SAME, BIG):
        assert Fifo().after_refusal(req, HEAD, head_waited=0.0) is Turn.STOP


def test_skip_ahead_lets_smaller_requests_pass_a_young_head_only() -> None:
    policy = SkipAhead(seconds=5.0)
    assert policy.after_refusal(SMALL, HEAD, head_waited=4.9) is Turn.TRY
    assert policy.after_refusal(SAME, HEAD, head_waited=4.9) is Turn.SKIP
    assert policy.after_refusal(BIG, HEAD, head_waited=0.0) is Turn.SKIP
    assert policy.after_refusal(SMALL, HEAD, head_waited=5.0) is Turn.STOP


def test_policies_by_name() -> None:
    assert queue_policy("fifo", 5.0) == Fifo()
    assert queue_policy("skip-ahead", 2.0) == SkipAhead(2.0)
    with pytest.raises(ValueError, match="queue policy"):
        queue_policy("lifo", 1.0)
    with pytest.raises(ValueError):
        SkipAhead(-1.0)
