"""The one server interceptor: shared-token authentication for every RPC, and the mapping of
typed errors (kv_service.status) to rich statuses plus latency metrics for every
KVCacheService RPC."""

from __future__ import annotations

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
    return factory(behavior, request_deserializer=_tolerant(handler.request_deserializer),
                   response_serializer=handler.response_serializer)


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
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if not method.startswith(UNAUTHENTICATED_PREFIXES) \
                and not self._authorized(details.invocation_metadata):
            return self._wrap(handler, method, Unauthenticated("missing or wrong bearer token"))
        if method.startswith(SERVICE_PREFIX):
            return self._wrap(handler, method[len(SERVICE_PREFIX):], None)
        return handler

    def _observe(self, method: str, code: str, started: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_rpc(method, code, time.perf_counter() - started)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str,
              refuse: BaseException | None) -> grpc.RpcMethodHandler:
        """Same kind of handler; `refuse` set means abort with it before running anything."""
        kind, inner = _kind(handler)
        observe = self._observe

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, code = time.perf_counter(), "OK"
            try:
                if refuse is not None:
                    raise refuse
                return await inner(_request(kind, request), context)
            except grpc.aio.AbortError:
                code = "ABORTED_BY_HANDLER"
                raise
            except Exception as exc:
                status = status_of(exc)
                code = status.code.name
                await _abort(context, status)
            finally:
                observe(method, code, started)

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if refuse is not None:
                    raise refuse
                async for reply in inner(_request(kind, request), context):
                    yield reply
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, status_of(exc))

        return _rebuild(handler, unary if kind.endswith("unary") else streaming)
