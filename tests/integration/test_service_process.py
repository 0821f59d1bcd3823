"""The service as a separate process over a temp UDS, driven by the generated client (CPU):
the session protocol, its error codes, auth, leases and remote swap, against one shared service
(the GPU variant starts its own).
Drain, crash recovery and the CLI are in tests/integration/test_service_lifecycle.py."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time

import grpc
import pytest
import torch
from lru_simulator import check_bijection
from service_harness import (
    TINY,
    RemoteSwapEngine,
    ServiceProcess,
    SessionClient,
    attach,
    handles_from_proto,
    short_tmpdir,
)

from contract import errors
from contract.codec import layout_to_proto
from contract.layout import MODE_OFFLOADED
from contract.segment_map import SegmentMap
from engine_client.client.status import from_rpc_error
from proto.kvcache.v1 import kvcache_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
TOKEN = "s3cret-token"
LEASE = 1.0


@pytest.fixture(scope="module")
def svc():
    workdir = short_tmpdir("kvsvc-t")
    service = ServiceProcess(
        workdir,
        f"t{os.getpid()}",
        "--lease-seconds",
        str(LEASE),
        "--max-message-bytes",
        "65536",
        "--drain-timeout",
        "2",
        token=TOKEN,
    )
    try:
        yield service.start().wait_serving()
        assert service.stop() == 0, service.log()
        assert service.segment_files() == [], service.log()
        assert not os.path.exists(service.uds)
    finally:
        service.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def code_of(call, *args, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value.code()


def test_attach_admit_commit_step_release(svc: ServiceProcess) -> None:
    assert stat.S_IMODE(os.stat(svc.uds).st_mode) == 0o600
    a = attach(svc, expected_layout=layout_to_proto(TINY))
    assert a.device == "cpu" and a.gpu_uuid == "" and a.lease_seconds == LEASE and a.epoch
    kv = SegmentMap().map_segments(TINY, handles_from_proto(a.tensors[:9]), "cpu")
    s = SessionClient(svc, a)
    small = s.admit("small", 5, 5).admitted
    big = s.admit("big", 30, 10).admitted
    assert small.mode == pb.RESIDENT and big.mode == pb.OFFLOADED and len(big.pages) == 10
    # The service wrote the page table into memory this process maps.
    assert kv.page_table[big.slot, :10].tolist() == list(big.pages)
    assert kv.req_mode[big.slot].item() == MODE_OFFLOADED
    assert s.send(commit=pb.Commit(request_id="big", seq_len=30)).HasField("ack")
    step = pb.StepEnd(
        step=1,
        progress=[pb.RequestProgress(request_id="big", seq_len=31)],
        hits=7,
        misses=2,
        bytes_moved=2304,
    )
    assert s.send(step_end=step).HasField("ack")
    assert s.send(heartbeat=pb.Heartbeat()).HasField("ack")
    stats = svc.stub().GetStats(pb.GetStatsRequest(), metadata=svc.metadata)
    assert stats.requests == 2 and stats.host_pages.used == 13 and stats.hits >= 7
    assert s.release("small").HasField("ack") and s.release("big").HasField("ack")
    assert s.send(detach=pb.Detach()).HasField("ack")
    s.close()
    stats = svc.stub().GetStats(pb.GetStatsRequest(), metadata=svc.metadata)
    assert stats.host_pages.used == 0 and stats.request_slots.used == 0


def test_admission_refused_with_numbers(svc: ServiceProcess) -> None:
    s = SessionClient(svc, attach(svc))
    assert s.admit("a", 60, 4).HasField("admitted")
    assert s.admit("b", 60, 4).HasField("admitted")
    err = s.admit("c", 10, 10).error
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert err.details["pages_needed"] == "5" and err.details["pages_free"] == "0"
    assert err.details["pages_total"] == "32"
    # The stream survives an in-band error.
    assert s.release("a").HasField("ack") and s.admit("c", 10, 10).HasField("admitted")
    s.send(detach=pb.Detach())
    s.close()


def test_in_band_error_codes(svc: ServiceProcess) -> None:
    a = attach(svc)
    s = SessionClient(svc, a)
    s.admit("r", 4, 4)
    codes = {
        "wrong epoch": s.send(epoch=a.epoch + 1, heartbeat=pb.Heartbeat()).error.code,
        "duplicate": s.admit("r", 4, 4).error.code,
        "bad seq_len": s.send(commit=pb.Commit(request_id="r", seq_len=9)).error.code,
        "negative": s.admit("n", -1, 4).error.code,
        "empty id": s.admit("", 4, 4).error.code,
        "too long": s.admit("x", 60, 60).error.code,
        "empty message": s.send().error.code,
        "other session": s.send(session_id="f" * 32, heartbeat=pb.Heartbeat()).error.code,
        "unknown request": s.release("ghost").error.code,
    }
    assert s.release("r").HasField("ack")
    codes["double release"] = s.release("r").error.code
    C = grpc.StatusCode
    assert codes == {
        "wrong epoch": C.FAILED_PRECONDITION.value[0],
        "duplicate": C.ALREADY_EXISTS.value[0],
        "bad seq_len": C.INVALID_ARGUMENT.value[0],
        "negative": C.INVALID_ARGUMENT.value[0],
        "empty id": C.INVALID_ARGUMENT.value[0],
        "too long": C.INVALID_ARGUMENT.value[0],  # can never fit: nobody may retry it
        "empty message": C.INVALID_ARGUMENT.value[0],
        "other session": C.INVALID_ARGUMENT.value[0],
        "unknown request": C.NOT_FOUND.value[0],
        "double release": C.NOT_FOUND.value[0],
    }
    s.close()


def test_unary_error_codes(svc: ServiceProcess) -> None:
    stub, md = svc.stub(), svc.metadata
    bad_layout = layout_to_proto(TINY)
    bad_layout.num_pages = 33
    assert (
        code_of(stub.Attach, pb.AttachRequest(expected_layout=bad_layout), metadata=md)
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Attach(pb.AttachRequest(resume_session_id="nope"), metadata=md)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    decoded = from_rpc_error(err.value, "Attach")
    assert type(decoded) is errors.UnknownSession and decoded.details == {"session_id": "nope"}
    a = attach(svc)
    assert (
        code_of(
            stub.RemoteSwap,
            pb.RemoteSwapRequest(session_id=a.session_id, epoch=a.epoch + 1, layer=0, batch_size=1),
            metadata=md,
        )
        == grpc.StatusCode.FAILED_PRECONDITION
    )
    assert (
        code_of(stub.Drain, pb.DrainRequest(timeout_seconds=-1), metadata=md)
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(stub.Attach, pb.AttachRequest(engine_name="x" * 100_000), metadata=md)
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


def test_unauthenticated(svc: ServiceProcess) -> None:
    stub = svc.stub()
    for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        assert (
            code_of(stub.Attach, pb.AttachRequest(), metadata=md) == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            code_of(stub.GetStats, pb.GetStatsRequest(), metadata=md)
            == grpc.StatusCode.UNAUTHENTICATED
        )
    stream = stub.Session(iter([pb.SessionMessage(seq=1, heartbeat=pb.Heartbeat())]))
    assert code_of(list, stream) == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open for probes.
    assert next(svc.health_statuses(5)) == 1


def test_lease_expiry_and_reattach(svc: ServiceProcess) -> None:
    a = attach(svc)
    s = SessionClient(svc, a)
    s.admit("long", 30, 10)
    s.send(commit=pb.Commit(request_id="long", seq_len=17))
    s.close()
    resumed = attach(svc, resume_session_id=a.session_id)
    assert resumed.session_id == a.session_id and resumed.epoch == a.epoch
    assert [(r.request_id, r.seq_len, r.reserved_tokens, r.mode) for r in resumed.requests] == [
        ("long", 17, 40, pb.OFFLOADED)
    ]
    closed = time.monotonic()
    # Without a stream the lease runs out and the request is reclaimed (expiry tick: lease / 4).
    while svc.stub().GetStats(pb.GetStatsRequest(), metadata=svc.metadata).requests:
        assert time.monotonic() < closed + 10 * LEASE, "lease never expired"
        time.sleep(LEASE / 8)
    assert time.monotonic() - closed >= 0.9 * LEASE
    assert (
        code_of(
            svc.stub().Attach,
            pb.AttachRequest(resume_session_id=a.session_id),
            metadata=svc.metadata,
        )
        == grpc.StatusCode.NOT_FOUND
    )


def residency(engine: RemoteSwapEngine, layer: int, slot: int) -> list[list[int]]:
    kv = engine.kv
    return [
        kv.slot_token[layer, slot].tolist(),
        kv.token_slot[layer, slot].tolist(),
        kv.lru_order[layer, slot].tolist(),
    ]


def check_repeated_positions_planned_once(engine: RemoteSwapEngine, slot: int) -> None:
    """A row [12, 12, 20, 20, 29, 29, w, w] once gave both copies of a miss a victim and
    orphaned a slot (then was refused): now each missed position is copied once and every copy
    reads its slot."""
    reply = engine.swap(1, slot, 30, [12, 12, 20, 20, 29, 29, -1, -1])
    assert (reply.misses, reply.hits, reply.bytes_moved) == (2, 4, 2 * TINY.row_bytes)
    got = engine.slots()
    assert got[0] == got[1] and got[2] == got[3] and got[4] == got[5] == 29 % TINY.window
    for t, s in ((12, got[0]), (20, got[2])):
        assert torch.equal(engine.kv.hot_kv[1, slot, s].cpu(), engine.host_row(slot, 1, t))
    check_bijection(*residency(engine, 1, slot), TINY.window)


def check_remote_swap(svc: ServiceProcess, device: str) -> None:
    """Misses copy the right host rows into the hot buffer; a repeat is all hits."""
    a = attach(svc, remote_swap=True)
    engine = RemoteSwapEngine(svc, a, device)
    s = SessionClient(svc, a)
    r = s.admit("swap", 30, 10).admitted
    s.send(commit=pb.Commit(request_id="swap", seq_len=30))
    engine.fill_host(r.slot, 30)
    first = engine.swap(1, r.slot, 30, list(range(8)))
    assert (first.hits, first.misses, first.bytes_moved) == (0, 8, 8 * TINY.row_bytes)
    slots = engine.slots()
    assert all(TINY.window <= slot < TINY.hot_slots for slot in slots)
    for t, slot in enumerate(slots):
        assert torch.equal(engine.kv.hot_kv[1, r.slot, slot].cpu(), engine.host_row(r.slot, 1, t))
    # A window position, a position past seq_len and padding: hits or skipped, nothing copied.
    second = engine.swap(1, r.slot, 30, [0, 1, 2, 3, 29, -1, 40, 5])
    assert (second.hits, second.misses) == (6, 0)
    assert engine.slots()[4:7] == [29 % TINY.window, -1, -1]
    check_repeated_positions_planned_once(engine, r.slot)
    # Rows sharing one plan: more than 4, or a union (2 k = 16) the 12 LRU slots cannot hold.
    for rows in (5, 2):
        with pytest.raises(grpc.RpcError) as err:
            engine.swap(1, r.slot, 30, list(range(8)), rows_per_request=rows)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rows
    with pytest.raises(grpc.RpcError) as err:
        engine.swap(2, r.slot, 30, list(range(8)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if device == "cpu":  # the ownership check would cost a device sync on CUDA
        with pytest.raises(grpc.RpcError) as err:
            engine.swap(0, (r.slot + 1) % TINY.max_requests, 30, list(range(8)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    engine.close()
    s.send(detach=pb.Detach())
    s.close()


def test_remote_swap_moves_the_right_rows(svc: ServiceProcess) -> None:
    check_remote_swap(svc, "cpu")
    # One session owns the exchange at a time; it is free again once that session is gone.
    owner = attach(svc, remote_swap=True)
    assert (
        code_of(svc.stub().Attach, pb.AttachRequest(remote_swap=True), metadata=svc.metadata)
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    SessionClient(svc, owner).send(detach=pb.Detach())
    assert any(t.name == "xchg_topk" for t in attach(svc, remote_swap=True).tensors)


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_service_on_gpu_cuda_ipc_events_and_remote_swap() -> None:
    workdir = short_tmpdir("kvsvc-g")
    # The host tier must be on tmpfs: since Linux 6.5 the kernel refuses the long-term pin that
    # cudaHostRegister takes on a writable file mapping of other filesystems (/tmp on the box).
    marker = os.path.basename(tempfile.gettempdir())  # the session's (tests/leftovers.py)
    shm_dir = tempfile.mkdtemp(prefix=f"{marker}-kvsvc-g", dir="/dev/shm")
    svc = ServiceProcess(workdir, f"g{os.getpid()}", "--device", "cuda", shm_dir=shm_dir)
    try:
        svc.start().wait_serving(300)
        a = attach(svc)
        assert a.device == "cuda" and a.gpu_uuid.startswith("GPU-")
        kinds = {t.name: t.kind for t in a.tensors}
        assert kinds.pop("host_kv") == "shm" and set(kinds.values()) == {"cuda_ipc"}
        check_remote_swap(svc, "cuda")
        assert svc.stop() == 0, svc.log()
        assert svc.segment_files() == []
    finally:
        svc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_reflection_lists_services(svc: ServiceProcess) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(svc.channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(stub.ServerReflectionInfo(iter([ask]), metadata=svc.metadata, timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"kvcache.v1.KVCacheService", "grpc.health.v1.Health"} <= names
    assert (
        code_of(list, stub.ServerReflectionInfo(iter([ask]), timeout=10))
        == grpc.StatusCode.UNAUTHENTICATED
    )
