"""What both of our gRPC servers (the KV service and the engine) do around every call of their
own service, whatever the method: transport only, no domain knowledge.

- A request that does not parse (bad protobuf bytes, invalid UTF-8 in a string field) reaches
  the handler as `Malformed` instead of failing in grpc's deserializer, which would answer
  UNKNOWN or INTERNAL and log a traceback per call; the call then ends with the server's answer
  to `InvalidArgument` (INVALID_ARGUMENT).
- Every call is counted with its status code and time in the go-grpc-prometheus series
  (`grpc_server_started_total`, `grpc_server_handled_total`, `grpc_server_handling_seconds`,
  labelled grpc_type / grpc_service / grpc_method and, once finished, grpc_code): `RpcMetrics`.
- An exception the handler raises becomes a status through the server's own `Abort` function
  (the KV service sends rich statuses; the engine plain ones).
Each server keeps its interceptor (which methods, authentication) and calls `wrap`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from contract.errors import InvalidArgument

# grpc_type label values of go-grpc-prometheus, by handler kind.
GRPC_TYPES = {
    "unary_unary": "unary",
    "unary_stream": "server_stream",
    "stream_unary": "client_stream",
    "stream_stream": "bidi_stream",
}
# RPCs over UDS take ~0.2-0.6 ms; remote swaps 30 us to a few ms; Generate streams seconds.
LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    200e-6,
    400e-6,
    800e-6,
    1.6e-3,
    3.2e-3,
    6.4e-3,
    12.8e-3,
    25.6e-3,
    51.2e-3,
    0.1,
    0.5,
    2.0,
    10.0,
    60.0,
)

# Abort the call (context.abort...) for an exception the handler raised.
Abort = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]


class RpcMetrics:
    """The three go-grpc-prometheus series, in the server's registry. The histogram keeps
    grpc_code too, to tell fast refusals from work."""

    def __init__(self, registry: CollectorRegistry) -> None:
        rpc = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter(
            "grpc_server_started_total", "RPCs started on the server", rpc, registry=registry
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code",
            rpc + ["grpc_code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "grpc_server_handling_seconds",
            "server time per RPC, from start to its status",
            rpc + ["grpc_code"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def rpc_start(self, kind: str, service: str, method: str) -> None:
        self.started.labels(kind, service, method).inc()

    def rpc_done(self, kind: str, service: str, method: str, code: str, seconds: float) -> None:
        """`kind` is grpc_type (unary, client_stream, server_stream, bidi_stream); `code` a
        grpc.StatusCode name (OK, NOT_FOUND, ...)."""
        self.handled.labels(kind, service, method, code).inc()
        self.seconds.labels(kind, service, method, code).observe(seconds)


def kind_of(handler: grpc.RpcMethodHandler) -> tuple[str, Callable[..., Any]]:
    if handler.unary_unary:
        return "unary_unary", handler.unary_unary
    if handler.unary_stream:
        return "unary_stream", handler.unary_stream
    if handler.stream_unary:
        return "stream_unary", handler.stream_unary
    return "stream_stream", handler.stream_stream


@dataclass(frozen=True)
class Malformed:
    """Stands for a request that did not parse."""

    error: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, Malformed):
        raise InvalidArgument(f"malformed message: {request.error}")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _code_name(context: grpc.aio.ServicerContext, default: str) -> str:
    """The status code the handler set (set_code or abort), else `default`."""
    try:
        code = context.code()
    except NotImplementedError:
        return default
    if code is None:
        return default
    return code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code).name


class _RecordedCall:
    """One method's behaviour behind an interceptor: counted, malformed requests refused,
    exceptions turned into statuses by `abort`; `refuse` set: abort with it before running."""

    def __init__(
        self,
        metrics: RpcMetrics | None,
        kind: str,
        method: str,
        inner: Callable[..., Any],
        abort: Abort,
        refuse: Exception | None,
    ) -> None:
        service, _, name = method.lstrip("/").rpartition("/")
        self._metrics, self._labels = metrics, (GRPC_TYPES[kind], service, name)
        self._kind, self._inner, self._abort, self._refuse = kind, inner, abort, refuse

    @contextlib.asynccontextmanager
    async def _recorded(self, context: grpc.aio.ServicerContext) -> AsyncIterator[list[str]]:
        """Count the call; the body sets the code it ends with on success."""
        if self._metrics is not None:
            self._metrics.rpc_start(*self._labels)
        started, code = time.perf_counter(), ["CANCELLED"]  # unless it ends by itself
        try:
            yield code
        except grpc.aio.AbortError:
            code[0] = _code_name(context, "UNKNOWN")
            raise
        except Exception as exc:
            try:
                await self._abort(exc, context)  # raises AbortError
            finally:
                code[0] = _code_name(context, "UNKNOWN")
        finally:
            if self._metrics is not None:
                self._metrics.rpc_done(*self._labels, code[0], time.perf_counter() - started)

    def _request(self, request: Any) -> Any:
        return _checked(request) if self._kind.startswith("unary") else _checked_stream(request)

    async def unary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._recorded(context) as code:
            if self._refuse is not None:
                raise self._refuse
            reply = await self._inner(self._request(request), context)
            code[0] = _code_name(context, "OK")
            return reply

    async def streaming(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async with self._recorded(context) as code:
            if self._refuse is not None:
                raise self._refuse
            async for reply in self._inner(self._request(request), context):
                yield reply
            code[0] = _code_name(context, "OK")


def wrap(
    handler: grpc.RpcMethodHandler,
    method: str,
    metrics: RpcMetrics | None,
    abort: Abort,
    refuse: Exception | None = None,
) -> grpc.RpcMethodHandler:
    """The same kind of handler, recorded, tolerant of malformed requests, and aborting with
    `abort` for what the handler raises (or for `refuse`, before running anything)."""
    kind, inner = kind_of(handler)
    call = _RecordedCall(metrics, kind, method, inner, abort, refuse)
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        call.unary if kind.endswith("unary") else call.streaming,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
