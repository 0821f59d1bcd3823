"""The one server interceptor: shared-token authentication for every RPC, and the mapping of
typed errors (kv_service.status) to rich statuses plus the grpc_server_* metrics (started,
handled by code, handling time) for every KVCacheService RPC and every refused one."""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kv_service.errors import InvalidArgument, Unauthenticated
from kv_service.metrics import ServiceMetrics
from kv_service.status import Status, rich_status, status_of

SERVICE_PREFIX = "/kvcache.v1.KVCacheService/"
# Health stays open so orchestrators can probe without the secret; it reveals nothing else.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


# grpc_type label values of go-grpc-prometheus, by handler kind.
GRPC_TYPES = {
    "unary_unary": "unary",
    "unary_stream": "server_stream",
    "stream_unary": "client_stream",
    "stream_stream": "bidi_stream",
}


def _kind(handler: grpc.RpcMethodHandler) -> tuple[str, Callable[..., Any]]:
    if handler.unary_unary:
        return "unary_unary", handler.unary_unary
    if handler.unary_stream:
        return "unary_stream", handler.unary_stream
    if handler.stream_unary:
        return "stream_unary", handler.stream_unary
    return "stream_stream", handler.stream_stream


@dataclass(frozen=True)
class _Malformed:
    """Stands for a request that did not parse. grpc answers INTERNAL for a deserializer that
    raises; passing this on instead lets the handler answer INVALID_ARGUMENT."""

    error: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return _Malformed(f"{type(exc).__name__}: {exc}")

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidArgument(f"malformed message: {request.error}")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    kind, _ = _kind(handler)
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        behavior,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


def _request(kind: str, request: Any) -> Any:
    return _checked(request) if kind.startswith("unary") else _checked_stream(request)


async def _abort(context: grpc.aio.ServicerContext, status: Status) -> None:
    await context.abort_with_status(rich_status(status))


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str | None, metrics: ServiceMetrics | None = None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None
        self._metrics = metrics

    def _authorized(self, metadata: Any) -> bool:
        if self._expected is None:
            return True
        given = dict(metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if not method.startswith(UNAUTHENTICATED_PREFIXES) and not self._authorized(
            details.invocation_metadata
        ):
            return self._wrap(handler, method, Unauthenticated("missing or wrong bearer token"))
        if method.startswith(SERVICE_PREFIX):
            return self._wrap(handler, method, None)
        return handler

    def _wrap(
        self, handler: grpc.RpcMethodHandler, method: str, refuse: BaseException | None
    ) -> grpc.RpcMethodHandler:
        """Same kind of handler; `refuse` set means abort with it before running anything."""
        kind, inner = _kind(handler)
        call = _RecordedCall(self._metrics, kind, method, inner, refuse)
        return _rebuild(handler, call.unary if kind.endswith("unary") else call.streaming)


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
    """The behaviour of one method behind the interceptor: typed errors become rich statuses,
    and every call is counted with its code and time (grpc_server_* metrics)."""

    def __init__(
        self,
        metrics: ServiceMetrics | None,
        kind: str,
        method: str,
        inner: Callable[..., Any],
        refuse: BaseException | None,
    ) -> None:
        service, _, name = method.lstrip("/").rpartition("/")
        self._metrics, self._labels = metrics, (GRPC_TYPES[kind], service, name)
        self._kind, self._inner, self._refuse = kind, inner, refuse

    def _start(self) -> float:
        if self._metrics is not None:
            self._metrics.rpc_start(*self._labels)
        return time.perf_counter()

    def _done(self, code: str, started: float) -> None:
        if self._metrics is not None:
            self._metrics.rpc_done(*self._labels, code, time.perf_counter() - started)

    @contextlib.asynccontextmanager
    async def _recorded(self, context: grpc.aio.ServicerContext) -> AsyncIterator[list[str]]:
        """Count the call; the body sets the code it ends with on success. A domain error
        aborts with its rich status."""
        started, code = self._start(), ["CANCELLED"]  # unless it ends by itself
        try:
            yield code
        except grpc.aio.AbortError:
            code[0] = _code_name(context, "UNKNOWN")
            raise
        except Exception as exc:
            status = status_of(exc)
            code[0] = status.code.name
            await _abort(context, status)
        finally:
            self._done(code[0], started)

    async def unary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._recorded(context) as code:
            if self._refuse is not None:
                raise self._refuse
            reply = await self._inner(_request(self._kind, request), context)
            code[0] = _code_name(context, "OK")
            return reply

    async def streaming(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async with self._recorded(context) as code:
            if self._refuse is not None:
                raise self._refuse
            async for reply in self._inner(_request(self._kind, request), context):
                yield reply
            code[0] = _code_name(context, "OK")
