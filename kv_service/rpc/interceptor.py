"""The one server interceptor: shared-token authentication for every RPC, and for every
KVCacheService RPC (refused ones included) the transport handling both our servers share
(`transport.rpc_calls`: malformed requests answered INVALID_ARGUMENT, grpc_server_* metrics),
with typed errors mapped to rich statuses (transport.status)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from contract.errors import Unauthenticated
from kv_service.rpc.metrics import ServiceMetrics
from transport import rpc_calls
from transport.status import rich_status, status_of

SERVICE_PREFIX = "/kvcache.v1.KVCacheService/"
# Health stays open so orchestrators can probe without the secret; it reveals nothing else.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


async def abort_rich(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    """Abort with the rich status of `exc`."""
    await context.abort_with_status(rich_status(status_of(exc)))


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str | None, metrics: ServiceMetrics | None = None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None
        self._metrics = metrics.rpc if metrics is not None else None

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
            refuse = Unauthenticated("missing or wrong bearer token")
            return rpc_calls.wrap(handler, method, self._metrics, abort_rich, refuse)
        if method.startswith(SERVICE_PREFIX):
            return rpc_calls.wrap(handler, method, self._metrics, abort_rich)
        return handler
