"""KVClient against a real `python -m kv_service` over UDS."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from contract import errors
from contract.layout import MAX_ROWS_PER_STEP, MODE_OFFLOADED, MODE_RESIDENT
from engine_client.client.control import StepReport
from engine_client.client.kv_client import KVClient
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.postprocess import ReportSender
from tests.process_harness import LAYOUT, layout_with, start_service, workdir

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def svc():
    with workdir("hsk") as path:
        service = start_service(path, lease=30.0)
        yield service
        assert service.stop() == 0, service.log()
        assert service.segment_files() == []


async def _connect(svc, **kw) -> KVClient:
    kw.setdefault("expected_layout", LAYOUT)
    return await KVClient.connect(
        f"unix:{svc.uds}",
        engine_name="test",
        rpc_timeout=3,
        attach_timeout=5,
        heartbeat_interval=0.2,
        **kw,
    )


@pytest.mark.slow
def test_session_lifecycle_and_typed_errors(svc) -> None:
    async def run() -> None:
        c = await _connect(svc)
        try:
            assert c.tensors is not None and c.tensors.layout == LAYOUT and c.device == "cpu"
            small = await c.admit("small", 8, 8)
            big = await c.admit("big", 40, 20)
            assert small.mode == MODE_RESIDENT and big.mode == MODE_OFFLOADED
            # The service wrote the page table into memory this process maps.
            assert c.tensors.page_table[big.slot, : len(big.pages)].tolist() == list(big.pages)
            fillers = []
            with pytest.raises(errors.CapacityError) as cap:
                for i in range(LAYOUT.max_requests):
                    fillers.append((await c.admit(f"fill{i}", 100, 28)).request_id)
            assert int(cap.value.details["pages_needed"]) > int(cap.value.details["pages_free"])
            for rid in fillers:
                await c.release(rid)
            with pytest.raises(errors.AlreadyExists):
                await c.admit("small", 8, 8)
            await c.commit("big", 40)
            await c.step_end(StepReport(1, (("big", 41), ("small", 9)), 10, 2, 2304))
            with pytest.raises(errors.InvalidArgument):
                await c.commit("small", 999)
            with pytest.raises(errors.UnknownRequest):
                await c.release("nope")
            s = await c.stats()
            assert (s.requests, s.hits, s.misses, s.bytes_moved) == (2, 10, 2, 2304)
            # Heartbeats run meanwhile (every 0.2 s); the stream stays healthy.
            await asyncio.sleep(0.5)
            for rid in ("small", "big"):
                await c.release(rid)
            assert (await c.stats()).pages_used == 0
        finally:
            await c.close(detach=True)

    asyncio.run(run())


@pytest.mark.slow
def test_merged_step_reports_are_bounded_by_their_step_count(svc) -> None:
    """Reports queued while one is on its way go out merged, each step at the most a step can
    do: the service takes them as that many steps; counters over steps x one step's bound are
    refused, and change nothing."""
    one_step = LAYOUT.num_layers * LAYOUT.topk * LAYOUT.max_requests * MAX_ROWS_PER_STEP
    row = LAYOUT.row_bytes + LAYOUT.index_bytes

    async def run() -> None:
        c = await _connect(svc)
        try:
            before = await c.stats()
            sender = ReportSender(ControlRef(c))
            for step in range(5):  # all sent before the first goes out: one report of 5 steps
                sender.send(StepReport(step, (), one_step - 1, 1, one_step * row))
            await sender.flush()
            assert sender.sent == 1
            s = await c.stats()
            assert (s.hits - before.hits, s.misses - before.misses) == (5 * one_step - 5, 5)
            assert s.bytes_moved - before.bytes_moved == 5 * one_step * row
            for over in (
                StepReport(9, (), 2 * one_step, 1, 0, steps=2),
                StepReport(9, (), 0, 0, 2 * one_step * row + 1, steps=2),
                StepReport(9, (), 0, 0, 0, steps=2**21),
            ):
                with pytest.raises(errors.InvalidArgument):
                    await c.step_end(over)
            assert (await c.stats()).hits == s.hits
        finally:
            await c.close(detach=True)

    asyncio.run(run())


@pytest.mark.slow
def test_layout_mismatch_is_refused(svc) -> None:
    with pytest.raises(errors.LayoutMismatch):
        asyncio.run(_connect(svc, expected_layout=layout_with(topk=8)))


@pytest.mark.slow
def test_stream_drop_reattaches_to_the_same_session(svc) -> None:
    async def run() -> None:
        c = await _connect(svc)
        try:
            await c.admit("keep", 8, 8)
            session = c.session_id
            c.session.stream._call.cancel()  # a dropped stream, the service still up
            await c.commit("keep", 8)  # waits for the re-attach, then goes through
            assert c.session_id == session and [h.request_id for h in c.held] == ["keep"]
            await c.release("keep")
        finally:
            await c.close(detach=True)

    asyncio.run(run())


@pytest.mark.slow
def test_remote_swap_runs_in_the_service(svc) -> None:
    async def run() -> None:
        c = await _connect(svc, remote_swap=True)
        try:
            adm = await c.admit("r", 4, 4)
            x = c.exchange
            x["xchg_topk"][0].fill_(-1)
            x["xchg_topk"][0, :3] = torch_arange(3)
            x["xchg_seq_lens"][0] = 3
            x["xchg_req_slots"][0] = adm.slot
            reply = await asyncio.get_running_loop().run_in_executor(None, c.remote_swap, 0, 1)
            # Resident request: position t is hot slot t, never a miss.
            assert (reply.hits, reply.misses) == (3, 0)
            assert x["xchg_slots"][0, :3].tolist() == [0, 1, 2]
            await c.release("r")
        finally:
            await c.close(detach=True)

    asyncio.run(run())


def torch_arange(n: int):
    import torch

    return torch.arange(n, dtype=torch.int32)


@pytest.mark.slow
def test_killed_service_fails_pending_calls_fast_and_drops_memory() -> None:
    with workdir("hsk") as path:
        service = start_service(path)

        async def run() -> float:
            c = await _connect(service)
            try:
                await c.admit("r", 8, 8)
                service.kill()
                started = time.monotonic()
                with pytest.raises(errors.ServiceUnavailable):
                    for _ in range(100):  # never returns normally once the service is gone
                        await c.commit("r", 8)
                elapsed = time.monotonic() - started
                with pytest.raises(errors.ServiceUnavailable):
                    c.check_alive()
                assert c.tensors is None  # nothing stale can be read
                with pytest.raises(errors.ServiceUnavailable):
                    await c.admit("again", 8, 8)
                return elapsed
            finally:
                await c.close()

        assert asyncio.run(run()) < 3.0


def test_a_reattach_where_nothing_listens_says_so(caplog) -> None:
    """A lost service's successor not started yet: the re-attach attempts log that nothing
    listens at the socket (it does not exist, or nobody accepts on it), not a bare deadline."""

    async def attempt(sock: str) -> str:
        caplog.clear()
        c = KVClient(f"unix:{sock}", engine_name="test", attach_timeout=0.2)
        c.recovery.dead = errors.ServiceUnavailable("lost (test)")
        task = asyncio.create_task(c.recovery.reattach())
        try:
            async with asyncio.timeout(10):
                while "re-attach to" not in caplog.text:
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await c.close()
        return caplog.text

    with workdir("hsn") as path:  # short: a socket path has ~100 characters at most
        sock = os.path.join(path, "kv.sock")
        absent = asyncio.run(attempt(sock))
        assert f"the socket {sock} does not exist" in absent and "Deadline" not in absent
        open(sock, "w").close()  # left by a stopped process
        stale = asyncio.run(attempt(sock))
        assert f"{sock} exists but nothing accepts connections on it" in stale
