"""bench.e2e's children start again on another metrics port when another process bound theirs
first (free_port names a port that was free a moment ago), and only then."""

from __future__ import annotations

import pytest

from bench.e2e import children
from engine_client.serve.procs import ChildFailed


class FakeChild:
    """Fails to serve on a port in `taken`, as a child whose bind lost the race does."""

    def __init__(self, port: int, taken: set[int], why: str) -> None:
        self.port, self.taken, self.why, self.stopped = port, taken, why, False

    def start(self) -> "FakeChild":
        return self

    def wait_serving(self, timeout: float) -> "FakeChild":
        if self.port in self.taken:
            raise ChildFailed(f"child exited with 1:\n{self.why}")
        return self

    def log(self) -> str:
        return self.why if self.port in self.taken else ""

    def stop(self) -> int:
        self.stopped = True
        return 0


def _children(monkeypatch, ports: list[int]) -> children.Children:
    handed = iter(ports)
    monkeypatch.setattr(children, "free_port", lambda: next(handed))
    return children.Children.__new__(children.Children)


def test_a_child_that_lost_its_port_starts_again_on_another(monkeypatch) -> None:
    ch = _children(monkeypatch, [4001, 4002, 4003])
    ch.timeout = 1.0
    made: list[FakeChild] = []

    def make(port: int) -> FakeChild:
        made.append(FakeChild(port, {4001, 4002}, "OSError: [Errno 98] Address already in use"))
        return made[-1]

    child, port = ch._serving(make)
    assert port == 4003 and child is made[-1]
    assert [c.stopped for c in made] == [True, True, False]


def test_other_failures_and_a_third_lost_race_are_raised(monkeypatch) -> None:
    ch = _children(monkeypatch, [4001, 4002, 4003])
    ch.timeout = 1.0
    with pytest.raises(ChildFailed, match="CUDA error"):
        ch._serving(lambda port: FakeChild(port, {4001}, "RuntimeError: CUDA error"))
    ch = _children(monkeypatch, [4001, 4002, 4003, 4004])
    ch.timeout = 1.0
    with pytest.raises(ChildFailed, match="Address already in use"):
        ch._serving(
            lambda port: FakeChild(port, {4001, 4002, 4003}, "OSError: Address already in use")
        )
