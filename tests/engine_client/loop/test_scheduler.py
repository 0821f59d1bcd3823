"""The scheduler's queue on its own (engine_client/loop/scheduler.py), with a KV side that admits
or refuses as told and a clock the test moves, and the failure handling that empties it
(engine_client/loop/failure.py):
- a request that waits past max_queue_wait ends with a message that names what held it: the
  admission limit (and its value) or KV capacity, never the one for the other;
- a lost KV service leaves no failed request in the scheduler's queue, its request table or its
  counts; the queued ones are found by id (a resume revives them) and marked lost in the state
  file;
- a cancel while an admission RPC is on its way (the churn test found it in the service modes):
  of that request (admitted: its slot kept for the releaser), of a refused head (the turn goes
  on behind it), or of one later in the turn (not admitted)."""

from __future__ import annotations

import asyncio

import pytest

from contract import errors
from engine_client.client.control import Admission
from engine_client.loop.admission_limit import AdmissionLimit
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.failure import Failures
from engine_client.loop.finished import FinishedRequests
from engine_client.loop.queue_policy import QueueLimits
from engine_client.loop.recovery import ServiceRecovery
from engine_client.loop.release import Finisher
from engine_client.loop.request import FailStatus, Finish, GenRequest, SamplingParams
from engine_client.loop.request_api import RequestAPI
from engine_client.loop.scheduler import Scheduler
from engine_client.loop.state_file import StateFile, load
from engine_client.loop.synthetic import SyntheticContext

MAX_WAIT = 10.0


class KVSide:
    """Admits into the next free slot while `capacity` lasts; refuses for capacity after."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.slots = capacity, 0
        self.asked: list[str] = []
        self.meanwhile: dict = {}  # request id -> what happens while its admission is on its way

    async def admit(self, request_id, prompt_len, max_new_tokens, prefix=None) -> Admission:
        self.asked.append(request_id)
        await asyncio.sleep(0)  # an RPC: other tasks run
        self.meanwhile.pop(request_id, lambda: None)()
        if self.slots >= self.capacity:
            raise errors.CapacityError("no free slot (test)", {})
        self.slots += 1
        return Admission(request_id, self.slots - 1, 1, prompt_len + max_new_tokens)


class Parts:
    """A scheduler over `KVSide(capacity)` under a fixed admission `limit`, its clock, and the
    failure handling and finished requests around it."""

    def __init__(self, limit: int, capacity: int, state: StateFile | None = None) -> None:
        self.now = 0.0
        self.wake = asyncio.Event()
        self.kv = KVSide(capacity)
        self.control = ControlRef(self.kv)  # type: ignore[arg-type]
        finisher = Finisher(state, self.wake)
        self.scheduler = Scheduler(
            self.control,
            QueueLimits(max_queue_wait=MAX_WAIT, admit_retry=0.1),
            admission=AdmissionLimit.fixed(limit),
            max_batch=4,
            prefill_chunk=8,
            synthetic=SyntheticContext(),
            finish=finisher.finish,
            state=state,
            clock=lambda: self.now,
        )
        self.finished = FinishedRequests(state)
        quiet = asyncio.Event()  # a step in flight: the recovery waits (the test ends first)
        recovery = ServiceRecovery(self.control, None, device_quiet=quiet)  # type: ignore[arg-type]
        self.failures = Failures(
            self.scheduler, self.control, recovery, state, finisher.finish, self.wake, self.finished
        )
        self.recovery = recovery
        self.api = RequestAPI(
            self.scheduler, self.failures, self.finished, finisher, state, self.wake
        )

    def submit(self, n: int) -> list[GenRequest]:
        reqs = [GenRequest(f"r{i}", (1, 2, 3), 4, SamplingParams()) for i in range(n)]
        for req in reqs:
            self.scheduler.enqueue(req)
        return reqs


@pytest.mark.parametrize(
    ("limit", "capacity", "named", "not_named"),
    [
        (1, 4, "admission limit 1 reached", "KV capacity"),
        (4, 1, "KV capacity for 7 tokens", "admission limit"),
    ],
    ids=["admission-limit", "kv-capacity"],
)
def test_a_queue_timeout_names_what_held_the_request(limit, capacity, named, not_named) -> None:
    async def run() -> tuple[GenRequest, GenRequest]:
        parts = Parts(limit, capacity)
        first, second = parts.submit(2)
        await parts.scheduler.schedule()  # the first runs, the second is held
        parts.now = MAX_WAIT + 1
        await parts.scheduler.schedule()
        return first, second

    first, second = asyncio.run(run())
    assert first.slot == 0 and not first.finished
    assert second.finish is Finish.ERROR and second.status is FailStatus.RESOURCE_EXHAUSTED
    assert named in second.error and not_named not in second.error, second.error
    assert f"waited {MAX_WAIT + 1:.1f} s" in second.error


def test_a_lost_service_leaves_no_failed_request_in_the_scheduler(tmp_path) -> None:
    path = str(tmp_path / "engine.state")
    state = StateFile(path)
    state.rewrite("s1", 1, [])

    async def run() -> tuple[Parts, list[GenRequest]]:
        parts = Parts(limit=1, capacity=4, state=state)
        reqs = parts.submit(3)
        for req in reqs:
            state.queued(req)
        await parts.scheduler.schedule()  # r0 admitted; r1, r2 held by the limit
        parts.failures.fail_all(errors.ServiceUnavailable("KV service gone (test)"))
        parts.recovery.cancel()
        return parts, reqs

    parts, (running, *queued) = asyncio.run(run())
    s = parts.scheduler
    # The admitted one stays until no launched step reads its slot (the releaser's turn).
    assert list(s.requests) == [running.request_id] and running.finished
    assert not s.waiting and not s.queued_at and not s.held and s.active() == 0
    for req in (running, *queued):
        assert req.finish is Finish.ERROR and req.status is FailStatus.UNAVAILABLE
        assert req.lost_kv and f"generate --resume {req.request_id}" in req.error
    assert [r.request_id for r in parts.finished.lost()] == [r.request_id for r in queued]
    saved = load(path).requests  # on disk at once: an engine killed now keeps all three
    assert sorted(r for r, s in saved.items() if s.lost) == ["r0", "r1", "r2"]


def test_cancels_while_admissions_are_on_their_way() -> None:
    """One slot: r0 is cancelled while its admission succeeds, r1 while it is refused (the
    head), r2 during r0's admission (later in the same turn); r3 goes on waiting."""

    async def run() -> Parts:
        parts = Parts(limit=4, capacity=1)
        r0, r1, r2, r3 = parts.submit(4)
        parts.kv.meanwhile = {
            "r0": lambda: (parts.api.cancel(r0), parts.api.cancel(r2)),
            "r1": lambda: parts.api.cancel(r1),
        }
        await parts.scheduler.schedule()
        parts.now = 1.0
        await parts.scheduler.schedule()  # the next turn: r3 refused again
        return parts

    parts = asyncio.run(run())
    r0, r1, r2, r3 = (parts.scheduler.requests[f"r{i}"] for i in range(4))
    assert parts.kv.asked == ["r0", "r1", "r3"]  # r2 never; r3 only once r1 (refused) left
    assert r0.finish is r1.finish is r2.finish is Finish.CANCELLED
    assert r0.slot == 0 and r1.slot == r2.slot == -1  # the releaser gives slot 0 back
    assert list(parts.scheduler.waiting) == [r3] and not r3.finished
    assert list(parts.scheduler.queued_at) == ["r3"]
