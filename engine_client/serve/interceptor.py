"""The engine server's interceptor: every decode.v1.DecodeService call gets the transport handling
the KV service's calls get (`transport.rpc_calls`): a request that does not parse is answered
INVALID_ARGUMENT, without a traceback, and each call is counted in the grpc_server_* series."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from transport import rpc_calls
from transport.status import rich_status, status_of

# The engine's own services: decode.v1, and prefill.v1 in a prefill engine.
SERVICE_PREFIX = ("/decode.v1.DecodeService/", "/prefill.v1.PrefillService/")


async def abort_rich(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    """decode.v1 errors carry the google.rpc.Status details kvcache.v1's do (code, message,
    ErrorInfo reason, QuotaFailure), from the one mapping `transport.status.status_of`; anything
    untyped is a bug: INTERNAL, logged with its traceback (by status_of), its text kept from
    the client."""
    await context.abort_with_status(rich_status(status_of(exc)))


class EngineInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: rpc_calls.RpcMetrics | None) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(SERVICE_PREFIX):
            return handler
        return rpc_calls.wrap(handler, details.method, self._metrics, abort_rich)
