"""The blocking RemoteSwap call of the compute thread (`client/remote_swap_call.py`) against a
real server: the request and the call's metadata arrive as given, and a refusal comes back as
the contract's error whose gRPC cause no longer holds the calling frames (they reach the mapped
memory, which a stored error must not keep)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from contract.errors import ServiceUnavailable, UnknownSession
from engine_client.client.remote_swap_call import RemoteSwapCall
from proto.kvcache.v1 import kvcache_pb2 as pb
from tests.grpc_harness import running_server
from transport.status import rich_status, status_of


class Swapper:
    def __init__(self) -> None:
        self.seen: list[tuple[pb.RemoteSwapRequest, dict]] = []

    async def remote_swap(self, request: pb.RemoteSwapRequest, context) -> pb.RemoteSwapResponse:
        self.seen.append((request, dict(context.invocation_metadata())))
        if request.session_id != "s1":
            await context.abort_with_status(rich_status(status_of(UnknownSession("no session"))))
        return pb.RemoteSwapResponse()

    def handlers(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_unary_rpc_method_handler(
            self.remote_swap,
            request_deserializer=pb.RemoteSwapRequest.FromString,
            response_serializer=pb.RemoteSwapResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            "kvcache.v1.KVCacheService", {"RemoteSwap": method}
        )


def _calls(*sessions: str) -> tuple[Swapper, list]:
    """Call RemoteSwap once per session id from a worker thread, as the compute thread does."""
    swapper, results = Swapper(), []

    def call_all(target: str) -> None:
        call = RemoteSwapCall(target, [], 5.0, (("authorization", "Bearer t"),))
        try:
            for sid in sessions:
                try:
                    results.append(call(sid, epoch=3, layer=1, batch_size=4, rows_per_request=2))
                except Exception as e:  # noqa: BLE001 - the test looks at it
                    results.append(e)
        finally:
            call.close()

    async def run() -> None:
        async with running_server("kvcache.v1.KVCacheService", [swapper.handlers()]) as srv:
            await asyncio.to_thread(call_all, srv.target)

    asyncio.run(run())
    return swapper, results


def test_the_request_and_metadata_arrive_as_given() -> None:
    swapper, results = _calls("s1", "s1")
    assert [type(r) for r in results] == [pb.RemoteSwapResponse] * 2  # one channel, reused
    request, metadata = swapper.seen[0]
    assert (request.session_id, request.epoch, request.layer) == ("s1", 3, 1)
    assert (request.batch_size, request.rows_per_request) == (4, 2)
    assert metadata["authorization"] == "Bearer t"


def test_a_refusal_is_the_contract_error_without_the_callers_frames() -> None:
    _, (err,) = _calls("other")
    assert isinstance(err, UnknownSession) and str(err).startswith("RemoteSwap: no session")
    causes = [c for c in (err.__cause__, err.__context__) if c is not None]
    assert causes and all(c.__traceback__ is None for c in causes)


def test_nothing_listening_is_service_unavailable() -> None:
    call = RemoteSwapCall("unix:/nowhere/kv.sock", [], 2.0, ())
    with pytest.raises(ServiceUnavailable, match="RemoteSwap"):
        call("s", epoch=1, layer=0, batch_size=1)
    call.close()
