"""Errors of a real service process as a client sees them: rich status (ErrorInfo reason and
metadata, QuotaFailure) on unary RPCs, the same reason and details in-band on the Session
stream, INVALID_ARGUMENT with a message for every malformed field, never UNKNOWN or INTERNAL,
and stats that survive absurd counters."""

from __future__ import annotations

import asyncio
import os
import shutil

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from service_harness import TINY, ServiceProcess, SessionClient, attach, short_tmpdir

from contract import errors
from contract.codec import layout_to_proto
from engine_client.client.status import code_of, from_rpc_error, from_status, rpc_errors
from proto.kvcache.v1 import kvcache_pb2 as pb
from proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
C = grpc.StatusCode
INVALID = C.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def svc():
    workdir = short_tmpdir("kvsvc-e")
    service = ServiceProcess(workdir, f"e{os.getpid()}")
    try:
        yield service.start().wait_serving()
        assert service.stop() == 0, service.log()
        assert "Traceback" not in service.log(), service.log()
    finally:
        service.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value


def test_capacity_numbers_round_trip_as_rich_status(svc: ServiceProcess) -> None:
    owner = attach(svc, remote_swap=True)
    err = rpc_error(svc.stub().Attach, pb.AttachRequest(engine_name="second", remote_swap=True))
    status = rpc_status.from_call(err)
    assert status is not None and err.code() == C.RESOURCE_EXHAUSTED
    info, quota = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(quota)
    assert (info.reason, info.domain) == ("CAPACITY_EXHAUSTED", "hisparse.kv")
    assert dict(info.metadata) == {
        "exchanges_needed": "1",
        "exchanges_free": "0",
        "exchanges_total": "1",
        "permanent": "false",
    }
    assert [(v.subject, v.description) for v in quota.violations] == [
        ("exchanges", "needed 1, free 0, total 1")
    ]
    decoded = from_rpc_error(err, "Attach")
    assert type(decoded) is errors.CapacityError and decoded.permanent is False
    assert decoded.details == {
        "exchanges_needed": "1",
        "exchanges_free": "0",
        "exchanges_total": "1",
    }
    SessionClient(svc, owner).send(detach=pb.Detach())


def test_not_found_and_invalid_argument_round_trip(svc: ServiceProcess) -> None:
    stub = svc.stub()
    missing = from_rpc_error(
        rpc_error(stub.Attach, pb.AttachRequest(resume_session_id="gone")), "Attach"
    )
    assert type(missing) is errors.UnknownSession and missing.details == {"session_id": "gone"}
    assert isinstance(missing, errors.UnknownRequest)
    bad = from_rpc_error(rpc_error(stub.Drain, pb.DrainRequest(timeout_seconds=-1)), "Drain")
    assert type(bad) is errors.InvalidArgument and bad.details == {"timeout_seconds": "-1.0"}
    layout = layout_to_proto(TINY)
    layout.num_pages = 33
    mismatch = from_rpc_error(
        rpc_error(stub.Attach, pb.AttachRequest(expected_layout=layout)), "Attach"
    )
    assert type(mismatch) is errors.LayoutMismatch and "num_pages" in mismatch.message


def test_aio_client_decodes_the_same_details(svc: ServiceProcess) -> None:
    async def attach_missing() -> errors.KVError:
        async with grpc.aio.insecure_channel(f"unix:{svc.uds}") as channel:
            with pytest.raises(errors.KVError) as err:
                with rpc_errors("Attach"):
                    await pb_grpc.KVCacheServiceStub(channel).Attach(
                        pb.AttachRequest(resume_session_id="gone"), timeout=10
                    )
            return err.value

    err = asyncio.run(attach_missing())
    assert type(err) is errors.UnknownSession and err.details == {"session_id": "gone"}
    assert code_of(err) is C.NOT_FOUND and err.message.startswith("Attach: ")


def test_request_that_can_never_fit_is_refused_at_once_as_permanent(svc: ServiceProcess) -> None:
    """INVALID_ARGUMENT, which nobody retries (RESOURCE_EXHAUSTED is for "not now")."""
    s = SessionClient(svc, attach(svc))
    reply = s.admit("huge", 60, 60).error
    assert reply.code == C.INVALID_ARGUMENT.value[0] and reply.reason == "CAPACITY_EXHAUSTED"
    assert reply.details["permanent"] == "true" and reply.details["tokens_needed"] == "120"
    err = from_status(reply.code, reply.message, dict(reply.details), reply.reason)
    assert type(err) is errors.CapacityError and err.permanent
    assert code_of(err) is C.INVALID_ARGUMENT
    assert err.details["tokens_total"] == str(TINY.max_context)
    assert s.admit("fits", 8, 8).HasField("admitted")
    s.send(detach=pb.Detach())
    s.close()


def test_absurd_step_counters_are_refused_and_stats_keep_working(svc: ServiceProcess) -> None:
    s = SessionClient(svc, attach(svc))
    for _ in range(3):
        reply = s.send(
            step_end=pb.StepEnd(step=1, hits=2**63 - 1, misses=2**63 - 1, bytes_moved=2**64 - 1)
        )
        assert reply.error.code == INVALID and reply.error.details["field"] == "hits"
    stats = svc.stub().GetStats(pb.GetStatsRequest())
    assert stats.hits < 2**32 and stats.misses < 2**32
    assert s.send(
        step_end=pb.StepEnd(step=2, hits=3, misses=1, bytes_moved=TINY.row_bytes)
    ).HasField("ack")
    assert svc.stub().GetStats(pb.GetStatsRequest()).hits == stats.hits + 3
    s.send(detach=pb.Detach())
    s.close()


def session_cases(session_id: str) -> dict[str, dict]:
    progress = [pb.RequestProgress(request_id=f"r{i}", seq_len=1) for i in range(100)]
    return {
        "empty request id": dict(admit=pb.Admit(request_id="", prompt_len=4, max_new_tokens=4)),
        "long request id": dict(admit=pb.Admit(request_id="x" * 200, prompt_len=4)),
        "control chars in id": dict(admit=pb.Admit(request_id="a\x00b", prompt_len=4)),
        "zero prompt": dict(admit=pb.Admit(request_id="z", prompt_len=0, max_new_tokens=4)),
        "negative prompt": dict(admit=pb.Admit(request_id="n", prompt_len=-5)),
        "negative max_new": dict(admit=pb.Admit(request_id="n", prompt_len=4, max_new_tokens=-1)),
        "huge prompt": dict(admit=pb.Admit(request_id="h", prompt_len=2**62)),
        "negative seq_len": dict(commit=pb.Commit(request_id="live", seq_len=-1)),
        "empty commit id": dict(commit=pb.Commit(request_id="", seq_len=1)),
        "too many progress entries": dict(step_end=pb.StepEnd(progress=progress)),
        "progress listed twice": dict(
            step_end=pb.StepEnd(progress=[pb.RequestProgress(request_id="live", seq_len=1)] * 2)
        ),
        "negative progress": dict(
            step_end=pb.StepEnd(progress=[pb.RequestProgress(request_id="live", seq_len=-3)])
        ),
        "misses over the step": dict(step_end=pb.StepEnd(misses=10**9)),
        "bytes over the step": dict(step_end=pb.StepEnd(bytes_moved=2**60)),
        "empty release id": dict(release=pb.Release(request_id="")),
        "missing oneof": {},
        "other session": dict(session_id="f" * 32, heartbeat=pb.Heartbeat()),
        "empty session id": dict(session_id="", heartbeat=pb.Heartbeat()),
        "long session id": dict(session_id="s" * 300, heartbeat=pb.Heartbeat()),
    }


def test_every_malformed_session_field_is_invalid_argument(svc: ServiceProcess) -> None:
    s = SessionClient(svc, attach(svc))
    assert s.admit("live", 4, 4).HasField("admitted")
    replies = {name: s.send(**body).error for name, body in session_cases(s.session_id).items()}
    assert {name: e.code for name, e in replies.items()} == {name: INVALID for name in replies}
    assert all(e.message and e.reason for e in replies.values())
    # Nothing above changed the live request, and the stream still works.
    assert s.send(commit=pb.Commit(request_id="live", seq_len=5)).HasField("ack")
    assert s.release("live").HasField("ack")
    s.send(detach=pb.Detach())
    s.close()


def test_every_malformed_unary_field_is_invalid_argument(svc: ServiceProcess) -> None:
    stub = svc.stub()
    a = attach(svc)
    cases = {
        "engine name too long": (stub.Attach, pb.AttachRequest(engine_name="e" * 500)),
        "engine name control chars": (stub.Attach, pb.AttachRequest(engine_name="a\nb")),
        "resume id too long": (stub.Attach, pb.AttachRequest(resume_session_id="s" * 300)),
        "drain timeout nan": (stub.Drain, pb.DrainRequest(timeout_seconds=float("nan"))),
        "drain timeout inf": (stub.Drain, pb.DrainRequest(timeout_seconds=float("inf"))),
    }
    for field in (
        "num_layers",
        "max_requests",
        "hot_slots",
        "window",
        "topk",
        "page_size",
        "num_pages",
        "max_context",
    ):
        for value in (0, -1, 2**62):
            layout = layout_to_proto(TINY)
            setattr(layout, field, value)
            cases[f"layout {field}={value}"] = (
                stub.Attach,
                pb.AttachRequest(expected_layout=layout),
            )
    layout = layout_to_proto(TINY)
    layout.row_format = "fp4"
    cases["layout row_format"] = (stub.Attach, pb.AttachRequest(expected_layout=layout))
    for name, kw in {
        "layer -1": dict(layer=-1, batch_size=1),
        "layer too big": dict(layer=2**40, batch_size=1),
        "batch 0": dict(layer=0, batch_size=0),
        "batch too big": dict(layer=0, batch_size=10**9),
        "no exchange": dict(layer=0, batch_size=1),
    }.items():
        cases[f"remote swap {name}"] = (
            stub.RemoteSwap,
            pb.RemoteSwapRequest(session_id=a.session_id, epoch=a.epoch, **kw),
        )
    cases["remote swap empty session"] = (
        stub.RemoteSwap,
        pb.RemoteSwapRequest(epoch=a.epoch, layer=0, batch_size=1),
    )
    codes = {name: rpc_error(call, request).code() for name, (call, request) in cases.items()}
    assert codes == {name: C.INVALID_ARGUMENT for name in cases}


def test_bytes_that_do_not_parse_are_invalid_argument(svc: ServiceProcess) -> None:
    garbage = b"\x0a\x10abc"  # field 1 says 16 bytes follow; 3 do
    for method in ("Attach", "GetStats", "Drain", "RemoteSwap"):
        call = svc.channel.unary_unary(f"/kvcache.v1.KVCacheService/{method}")
        err = rpc_error(call, garbage, timeout=10)
        assert err.code() == C.INVALID_ARGUMENT and "malformed" in err.details(), method
    stream = svc.channel.stream_stream("/kvcache.v1.KVCacheService/Session")
    err = rpc_error(lambda: list(stream(iter([garbage]), timeout=10)))
    assert err.code() == C.INVALID_ARGUMENT and "malformed" in err.details()
