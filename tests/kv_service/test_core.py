"""ServiceCore in-process: sessions, admission, commits, leases, validation."""

from __future__ import annotations

import pytest
import torch

from contract.errors import (
    AlreadyExists,
    CapacityError,
    Draining,
    EpochMismatch,
    InvalidArgument,
    UnknownRequest,
    UnknownSession,
)
from contract.layout import (
    MAX_ROWS_PER_STEP,
    MODE_FREE,
    MODE_OFFLOADED,
    MODE_RESIDENT,
    KVLayout,
    LayoutError,
)
from kv_service.core import ServiceCore
from kv_service.memory.store import allocate_local

LAYOUT = KVLayout(
    num_layers=2,
    max_requests=4,
    hot_slots=16,
    window=4,
    topk=8,
    page_size=4,
    num_pages=32,
    max_context=64,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(clock: Clock) -> ServiceCore:
    return ServiceCore(allocate_local(LAYOUT), lease_seconds=5.0, epoch=7, clock=clock)


def test_admit_modes_pages_and_tensors(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    small = core.admit(sid, "a", prompt_len=10, max_new_tokens=6)
    big = core.admit(sid, "b", prompt_len=30, max_new_tokens=10)
    assert small.mode == MODE_RESIDENT and big.mode == MODE_OFFLOADED
    assert (small.slot, big.slot) == (0, 1)
    assert len(small.pages) == 4 and len(big.pages) == 10
    assert core.kv.req_mode[:2].tolist() == [MODE_RESIDENT, MODE_OFFLOADED]
    assert core.kv.page_table[1, :10].tolist() == big.pages
    assert (core.kv.page_table[1, 10:] == -1).all()
    core.commit(sid, "b", 30)
    core.step_end(sid, [("a", 11), ("b", 31)], hits=5, misses=3, bytes_moved=3 * 1152)
    assert (small.seq_len, big.seq_len) == (11, 31)
    stats = core.stats()
    assert (stats.hits, stats.misses, stats.bytes_moved) == (5, 3, 3456)
    assert (stats.pages_used, stats.offloaded_pages_used, stats.slots_used) == (14, 10, 2)
    core.release(sid, "a")
    core.release(sid, "b")
    assert core.kv.req_mode.tolist() == [MODE_FREE] * 4
    assert core.is_empty()


def test_capacity_refusal_has_numbers(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    core.admit(sid, "a", 60, 4)
    core.admit(sid, "b", 60, 4)
    with pytest.raises(CapacityError) as err:
        core.admit(sid, "c", 10, 10)
    assert err.value.details["pages_needed"] == "5" and err.value.details["pages_free"] == "0"
    assert core.stats().rejected_total == 1
    core.release(sid, "a")
    core.admit(sid, "c", 10, 10)


def test_slot_exhaustion(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    for i in range(4):
        core.admit(sid, f"r{i}", 1, 0)
    with pytest.raises(CapacityError) as err:
        core.admit(sid, "r4", 1, 0)
    assert err.value.details["slots_free"] == "0"


def test_double_release_and_unknown(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    core.admit(sid, "a", 4, 4)
    core.release(sid, "a")
    with pytest.raises(UnknownRequest):
        core.release(sid, "a")
    with pytest.raises(UnknownRequest):
        core.commit(sid, "nope", 1)
    with pytest.raises(UnknownSession):
        core.admit("no-such-session", "a", 1, 1)
    assert core.is_empty()


def test_sessions_cannot_touch_each_others_requests(core: ServiceCore) -> None:
    one, two = core.attach("e1").session_id, core.attach("e2").session_id
    core.admit(one, "shared-name", 4, 4)
    with pytest.raises(UnknownRequest):
        core.release(two, "shared-name")
    with pytest.raises(UnknownRequest):
        core.commit(two, "shared-name", 1)
    core.admit(two, "shared-name", 4, 4)
    core.release(one, "shared-name")
    core.release(two, "shared-name")
    assert core.is_empty()


@pytest.mark.parametrize(
    "rid,prompt,new",
    [
        ("", 1, 1),
        ("x" * 129, 1, 1),
        ("bad\nid", 1, 1),
        ("a", 0, 1),
        ("a", -1, 1),
        ("a", 1, -1),
        ("a", 2**40 + 1, 1),
        ("a", 1, 2**62),
    ],
)
def test_admit_validation(core: ServiceCore, rid: str, prompt: int, new: int) -> None:
    sid = core.attach("eng").session_id
    with pytest.raises(InvalidArgument):
        core.admit(sid, rid, prompt, new)
    assert core.is_empty()


@pytest.mark.parametrize("prompt,new", [(65, 0), (60, 5), (2**40, 1)])
def test_admit_that_can_never_fit_is_permanent(core: ServiceCore, prompt: int, new: int) -> None:
    sid = core.attach("eng").session_id
    with pytest.raises(CapacityError) as err:
        core.admit(sid, "a", prompt, new)
    assert err.value.permanent and err.value.details["tokens_needed"] == str(prompt + new)
    assert err.value.details["tokens_total"] == "64" and core.is_empty()
    # A request that fits an empty service but not the free pages now is not permanent.
    core.admit(sid, "big", 60, 4)
    core.admit(sid, "big2", 60, 4)
    with pytest.raises(CapacityError) as busy:
        core.admit(sid, "c", 8, 8)
    assert not busy.value.permanent and busy.value.details["pages_free"] == "0"


def test_step_counters_are_bounded_by_what_a_step_can_do(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    # A speculative step plans up to MAX_ROWS_PER_STEP rows of top-k per (layer, request).
    positions = LAYOUT.num_layers * LAYOUT.topk * LAYOUT.max_requests * MAX_ROWS_PER_STEP
    for hits, misses, nbytes in (
        (2**63 - 1, 0, 0),
        (positions + 1, 0, 0),
        (positions, 1, 0),
        (0, 0, -1),
        (-1, 0, 0),
        (0, 1, positions * 10**6),
    ):
        with pytest.raises(InvalidArgument):
            core.step_end(sid, [], hits, misses, nbytes)
    core.step_end(sid, [], positions - 3, 3, 3 * LAYOUT.row_bytes)
    stats = core.stats()
    assert (stats.hits, stats.misses, stats.bytes_moved) == (positions - 3, 3, 3 * LAYOUT.row_bytes)


def test_commit_and_step_end_validation(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    core.admit(sid, "a", 8, 8)
    for bad in (-1, 17, 2**40):
        with pytest.raises(InvalidArgument):
            core.commit(sid, "a", bad)
    core.commit(sid, "a", 16)
    with pytest.raises(InvalidArgument):
        core.step_end(sid, [("a", 9), ("a", 10)], 0, 0, 0)
    with pytest.raises(UnknownRequest):
        core.step_end(sid, [("a", 9), ("ghost", 1)], 1, 1, 1)
    with pytest.raises(InvalidArgument):
        core.step_end(sid, [], -1, 0, 0)
    assert core.request(sid, "a").seq_len == 16 and core.stats().hits == 0
    with pytest.raises(AlreadyExists):
        core.admit(sid, "a", 1, 1)


def test_lease_expiry_reclaims_and_open_stream_holds(core: ServiceCore, clock: Clock) -> None:
    sid = core.attach("eng").session_id
    core.admit(sid, "a", 40, 8)
    core.table.stream_opened(sid)
    clock.now += 100
    assert core.expire_leases() == []
    core.table.stream_closed(sid)
    clock.now += 4
    assert core.expire_leases() == []
    resumed = core.attach("eng-restarted", resume_session_id=sid)
    assert resumed.session_id == sid and list(resumed.requests) == ["a"]
    clock.now += 5.1
    assert core.expire_leases() == [sid]
    assert core.is_empty() and core.stats().expired_sessions_total == 1
    with pytest.raises(UnknownSession):
        core.attach("late", resume_session_id=sid)


def test_detach_frees_everything_and_calls_back(clock: Clock) -> None:
    closed: list[str] = []
    core = ServiceCore(
        allocate_local(LAYOUT), lease_seconds=1, clock=clock, on_session_closed=closed.append
    )
    sid = core.attach("eng").session_id
    core.admit(sid, "a", 4, 4)
    core.admit(sid, "b", 40, 4)
    core.detach(sid)
    assert closed == [sid] and core.is_empty() and not core.table.sessions


def test_epoch_and_layout_checks(core: ServiceCore) -> None:
    core.check_epoch(7)
    with pytest.raises(EpochMismatch):
        core.check_epoch(8)
    core.attach("eng", expected_layout=LAYOUT)
    with pytest.raises(LayoutError):
        core.attach("eng", expected_layout=KVLayout(**{**LAYOUT.to_dict(), "num_pages": 33}))
    assert core.epoch != ServiceCore(allocate_local(LAYOUT), lease_seconds=1).epoch


def test_drain_refuses_admission_but_allows_release(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    core.admit(sid, "a", 4, 4)
    core.start_drain()
    with pytest.raises(Draining):
        core.admit(sid, "b", 4, 4)
    core.commit(sid, "a", 5)
    core.release(sid, "a")
    assert core.is_empty() and core.stats().draining


def test_reset_clears_previous_residency(core: ServiceCore) -> None:
    sid = core.attach("eng").session_id
    first = core.admit(sid, "a", 30, 10)
    core.kv.token_slot[:, first.slot, :5] = 3
    core.release(sid, "a")
    second = core.admit(sid, "b", 30, 10)
    assert second.slot == first.slot
    assert (core.kv.token_slot[:, second.slot] == -1).all()
    expected = torch.arange(LAYOUT.window, LAYOUT.hot_slots, dtype=torch.int32)
    assert (core.kv.lru_order[:, second.slot] == expected).all()
