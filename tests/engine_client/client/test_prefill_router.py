"""Routing a decode engine's prompts over its prefill peers (client.prefill_router): round-robin,
a peer that is down or full passed over for its backoff, and in again once it answers. Fake
peers and a fake clock: no process, no nixl."""

from __future__ import annotations

import asyncio

import pytest

from contract.errors import CapacityError, InvalidArgument, ServiceUnavailable
from engine_client.client.prefill_router import DOWN_BACKOFF, FULL_BACKOFF, PrefillRouter


class Peer:
    def __init__(self, target: str) -> None:
        self.target = target
        self.closed = False

    async def prefill(self, *args, **kwargs):
        raise AssertionError("the router does not call its peers")

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _router(n: int = 3) -> tuple[PrefillRouter, list[Peer], Clock]:
    peers, clock = [Peer(f"p{i}") for i in range(n)], Clock()
    return PrefillRouter(peers, clock), peers, clock


def _targets(router: PrefillRouter, k: int) -> list[str | None]:
    return [p.target if (p := router.pick()) is not None else None for _ in range(k)]


def test_peers_take_turns() -> None:
    router, _, _ = _router()
    assert _targets(router, 7) == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]


def test_a_down_peer_is_passed_over_until_its_backoff_ends() -> None:
    router, peers, clock = _router()
    assert router.failed(peers[1], ServiceUnavailable("connection refused"))
    assert _targets(router, 4) == ["p0", "p2", "p0", "p2"]
    assert router.left_out() == ["p1"]
    clock.now += DOWN_BACKOFF[0]
    assert "p1" in _targets(router, 3)


def test_a_peer_down_again_and_again_waits_longer_up_to_the_cap() -> None:
    router, peers, clock = _router(1)
    waits = []
    for _ in range(10):
        router.failed(peers[0], ServiceUnavailable("gone"))
        start = clock.now
        while router.pick() is None:
            clock.now += 0.25
        waits.append(clock.now - start)
    assert waits[:3] == [DOWN_BACKOFF[0], 2 * DOWN_BACKOFF[0], 4 * DOWN_BACKOFF[0]]
    assert max(waits) == DOWN_BACKOFF[1]
    router.served(peers[0])  # it answered: in again, its failures forgotten
    router.failed(peers[0], ServiceUnavailable("gone"))
    assert router.until_free() is None  # down, not full: nothing to wait for
    clock.now += DOWN_BACKOFF[0]
    assert router.pick() is peers[0]


def test_a_full_peer_is_left_out_briefly_and_is_worth_waiting_for() -> None:
    router, peers, clock = _router(2)
    assert router.failed(peers[0], CapacityError("full"))
    assert router.failed(peers[1], CapacityError("full"))
    assert router.pick() is None
    assert router.until_free() == pytest.approx(FULL_BACKOFF)
    clock.now += FULL_BACKOFF
    assert router.pick() is not None


def test_peers_tried_for_a_prompt_are_not_picked_for_it_again() -> None:
    router, peers, _ = _router(2)
    assert router.pick(tried=[peers[0]]) is peers[1]
    assert router.pick(tried=peers) is None


def test_a_refusal_of_the_prompt_itself_does_not_leave_the_peer_out() -> None:
    router, peers, _ = _router(2)
    assert not router.failed(peers[0], InvalidArgument("layout mismatch"))
    assert router.left_out() == []


def test_close_closes_every_peer() -> None:
    router, peers, _ = _router()
    asyncio.run(router.close())
    assert all(p.closed for p in peers)


def test_a_router_needs_a_peer() -> None:
    with pytest.raises(ValueError):
        PrefillRouter([])
