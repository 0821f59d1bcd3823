"""Page and slot allocators: plain Python, no torch."""

from __future__ import annotations

import random

import pytest

from contract.errors import CapacityError
from kv_service.books.pool import PagePool, SlotPool


def test_take_lowest_first_and_return_to_empty() -> None:
    pool = PagePool(8)
    a = pool.take(3)
    b = pool.take(2)
    assert a == [0, 1, 2] and b == [3, 4]
    assert (pool.used, pool.free) == (5, 3)
    pool.give_back(a)
    assert pool.take(1) == [0]
    pool.give_back([0])
    pool.give_back(b)
    assert pool.is_empty()


def test_capacity_error_carries_numbers() -> None:
    pool = PagePool(4)
    pool.take(3)
    with pytest.raises(CapacityError) as err:
        pool.take(2)
    assert err.value.details == {"pages_needed": "2", "pages_free": "1", "pages_total": "4"}
    assert pool.used == 3


@pytest.mark.parametrize("bad", [[7], [0, 0], [99]])
def test_give_back_rejects_foreign_and_repeated(bad: list[int]) -> None:
    pool = SlotPool(8)
    pool.take(1)
    pool.take(7)
    pool.give_back([7])
    with pytest.raises(ValueError):
        pool.give_back(bad)
    assert pool.used == 7


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        PagePool(0)
    with pytest.raises(ValueError):
        PagePool(3).take(-1)
    assert PagePool(3).take(0) == []


def test_random_churn_returns_to_empty() -> None:
    rng = random.Random(0)
    pages, slots = PagePool(64), SlotPool(8)
    live: list[tuple[int, list[int]]] = []
    for _ in range(2000):
        if live and (rng.random() < 0.5 or slots.free == 0):
            slot, got = live.pop(rng.randrange(len(live)))
            slots.give_back([slot])
            pages.give_back(got)
            continue
        try:
            got = pages.take(rng.randint(0, 20))
        except CapacityError:
            continue
        live.append((slots.take_one(), got))
        owned = [p for _, got in live for p in got]
        assert len(owned) == len(set(owned)) == pages.used
    for slot, got in live:
        slots.give_back([slot])
        pages.give_back(got)
    assert pages.is_empty() and slots.is_empty()
