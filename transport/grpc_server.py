"""The one gRPC server scaffold of both processes (the KV service, the engine): an aio server
with keepalive, the standard health service and reflection. Each side adds its servicer, its
interceptors and its listening sockets."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

# A peer that vanished without closing (TCP) is found within ~15 s.
KEEPALIVE = (("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000))


def scaffold(
    service_name: str,
    health: health_aio.HealthServicer,
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    options: Sequence[tuple[str, int]] = (),
) -> grpc.aio.Server:
    """A server with keepalive (plus `options`), `health` and reflection of `service_name`."""
    server = grpc.aio.server(interceptors=list(interceptors), options=[*KEEPALIVE, *options])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        (service_name, health_name, reflection.SERVICE_NAME), server
    )
    return server


async def set_health(health: health_aio.HealthServicer, service_name: str, serving: bool) -> None:
    """The overall status ("") and the service's, together."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", service_name):
        await health.set(name, status)
