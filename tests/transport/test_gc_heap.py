"""transport/gc_heap.py: freezing the start-up heap keeps later garbage collectable and makes a
full collection skip what was frozen; GcPauses counts the collections and their time and
exports them."""

from __future__ import annotations

import gc
import weakref

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from transport.gc_heap import GcPauses, freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def thawed():
    """Every test leaves the worker's heap as it found it."""
    yield
    gc.unfreeze()


def test_frozen_objects_stay_and_later_cycles_are_still_collected(thawed) -> None:
    before = Node()
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    kept = weakref.ref(before)
    del before
    gc.collect()
    assert kept() is not None  # frozen: a full collection no longer looks at it
    later = Node()
    freed = weakref.ref(later)
    del later
    gc.collect()
    assert freed() is None  # allocated after the freeze: collected as before
    gc.unfreeze()
    gc.collect()
    assert kept() is None  # thawed, the start-up cycle is garbage again


def test_pauses_count_full_collections_and_export_them() -> None:
    pauses = GcPauses("engine").install()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    t = pauses.totals
    assert t.full_collections == 1
    assert 0 < t.full_seconds <= t.seconds
    assert 0 < t.longest <= t.seconds
    gc.collect()  # uninstalled: no longer counted
    assert pauses.totals.full_collections == 1
    registry = CollectorRegistry()
    registry.register(pauses)
    text = generate_latest(registry).decode()
    assert "engine_gc_full_collections_total 1.0" in text
    for name in ("engine_gc_seconds_total", "engine_gc_full_seconds_total"):
        assert f"{name} " in text
    assert "engine_gc_pause_max_seconds " in text
