"""Per-call handling both servers share (`transport/rpc_calls.py`), on a real aio server: every
call counted in the go-grpc-prometheus series with the code it ended with, a request that does
not parse refused as InvalidArgument before the handler runs, a raised error (or a refusal)
handed to the server's own abort function."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from contract.errors import InvalidArgument, KVError, Unauthenticated, UnknownRequest
from tests.grpc_harness import running_server
from transport import rpc_calls

SERVICE = "test.v1.Echo"
Request, Reply = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
CODES = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownRequest: grpc.StatusCode.NOT_FOUND,
}


class Echo:
    """Unary: SERVING, or UnknownRequest for service "boom"; Stream: one reply per character."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def unary(self, request: Request, context) -> Reply:
        self.ran.append(request.service)
        if request.service == "boom":
            raise UnknownRequest("no such request")
        return Reply(status=Reply.SERVING)

    async def stream(self, request: Request, context):
        self.ran.append(request.service)
        for _ in request.service:
            yield Reply(status=Reply.SERVING)

    def handlers(self) -> grpc.GenericRpcHandler:
        kw = dict(
            request_deserializer=Request.FromString, response_serializer=Reply.SerializeToString
        )
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary, **kw),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream, **kw),
            },
        )


class Wrapping(grpc.aio.ServerInterceptor):
    """What each server's interceptor does: wrap its own service's methods."""

    def __init__(self, metrics: rpc_calls.RpcMetrics, refuse: KVError | None = None) -> None:
        self.metrics, self.refuse, self.aborted = metrics, refuse, []

    async def abort(self, exc: Exception, context) -> None:
        self.aborted.append(exc)
        code = CODES.get(type(exc), grpc.StatusCode.FAILED_PRECONDITION)
        await context.abort(code, str(exc))

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler
        return rpc_calls.wrap(handler, details.method, self.metrics, self.abort, self.refuse)


def _serve(calls, refuse: KVError | None = None):
    """Run `calls(channel)` against an Echo server; (its result, echo, interceptor, registry)."""
    registry = CollectorRegistry()
    echo, wrapping = Echo(), Wrapping(rpc_calls.RpcMetrics(registry), refuse)

    async def run():
        async with running_server(SERVICE, [echo.handlers()], [wrapping]) as srv:
            return await calls(srv.channel)

    return asyncio.run(run()), echo, wrapping, registry


def _handled(registry: CollectorRegistry, method: str, code: str, kind: str = "unary") -> float:
    labels = dict(grpc_type=kind, grpc_service=SERVICE, grpc_method=method, grpc_code=code)
    return registry.get_sample_value("grpc_server_handled_total", labels) or 0.0


def _unary(channel, raw: bool = False):
    serialize = None if raw else Request.SerializeToString
    return channel.unary_unary(
        f"/{SERVICE}/Unary", request_serializer=serialize, response_deserializer=Reply.FromString
    )


async def _code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def test_a_call_is_counted_with_its_code_and_time() -> None:
    reply, echo, _, registry = _serve(lambda ch: _unary(ch)(Request(service="a"), timeout=5))
    assert reply.status == Reply.SERVING and echo.ran == ["a"]
    labels = dict(grpc_type="unary", grpc_service=SERVICE, grpc_method="Unary")
    assert registry.get_sample_value("grpc_server_started_total", labels) == 1
    assert _handled(registry, "Unary", "OK") == 1
    timed = registry.get_sample_value(
        "grpc_server_handling_seconds_count", {**labels, "grpc_code": "OK"}
    )
    assert timed == 1


def test_a_raised_error_goes_through_the_servers_abort() -> None:
    code, echo, wrapping, registry = _serve(
        lambda ch: _code_of(_unary(ch)(Request(service="boom"), timeout=5))
    )
    assert code is grpc.StatusCode.NOT_FOUND and echo.ran == ["boom"]
    assert [type(e) for e in wrapping.aborted] == [UnknownRequest]
    assert _handled(registry, "Unary", "NOT_FOUND") == 1


def test_a_request_that_does_not_parse_never_reaches_the_handler() -> None:
    # Field 1 (a string) holding bytes that are not UTF-8: grpc's own parser would fail the call.
    bad = b"\x0a\x02\xff\xfe"
    code, echo, wrapping, registry = _serve(
        lambda ch: _code_of(_unary(ch, raw=True)(bad, timeout=5))
    )
    assert code is grpc.StatusCode.INVALID_ARGUMENT and echo.ran == []
    assert isinstance(wrapping.aborted[0], InvalidArgument)
    assert "malformed message" in str(wrapping.aborted[0])
    assert _handled(registry, "Unary", "INVALID_ARGUMENT") == 1


def test_a_refused_call_aborts_before_the_handler_runs() -> None:
    code, echo, wrapping, _ = _serve(
        lambda ch: _code_of(_unary(ch)(Request(service="a"), timeout=5)),
        refuse=Unauthenticated("no token"),
    )
    assert code is grpc.StatusCode.FAILED_PRECONDITION and echo.ran == []
    assert [type(e) for e in wrapping.aborted] == [Unauthenticated]


def test_a_stream_is_counted_once_when_it_ends() -> None:
    async def stream(channel) -> int:
        call = channel.unary_stream(
            f"/{SERVICE}/Stream",
            request_serializer=Request.SerializeToString,
            response_deserializer=Reply.FromString,
        )
        return len([r async for r in call(Request(service="abc"), timeout=5)])

    replies, _, _, registry = _serve(stream)
    assert replies == 3
    assert _handled(registry, "Stream", "OK", kind="server_stream") == 1
