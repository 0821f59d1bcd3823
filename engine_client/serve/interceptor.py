"""The engine server's interceptor: every decode.v1.DecodeService call gets the transport handling
the KV service's calls get (`transport.rpc_calls`): a request that does not parse is answered
INVALID_ARGUMENT, without a traceback, and each call is counted in the grpc_server_* series."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from engine_client.client import errors
from transport import rpc_calls

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/decode.v1.DecodeService/"


async def abort_plain(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    """decode.v1 statuses are plain code + message. A typed error keeps its code; anything
    else is a bug: INTERNAL, logged with its traceback, its text kept from the client."""
    if isinstance(exc, errors.KVError):
        await context.abort(errors.code_of(exc), exc.message)
    log.error("Generate failed", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


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
        return rpc_calls.wrap(handler, details.method, self._metrics, abort_plain)
