"""The one gRPC server scaffold (`transport/grpc_server.py`): health for the server and its
service together, and reflection naming the service, as both of our servers rely on."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.grpc_harness import running_server
from transport import grpc_server

SERVICE = "kvcache.v1.KVCacheService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def test_health_moves_the_server_and_its_service_together() -> None:
    async def run() -> None:
        async with running_server(SERVICE) as srv:
            await grpc_server.set_health(srv.health, SERVICE, False)
            assert [await _status(srv.channel, s) for s in ("", SERVICE)] == [NOT_SERVING] * 2
            await grpc_server.set_health(srv.health, SERVICE, True)
            assert [await _status(srv.channel, s) for s in ("", SERVICE)] == [SERVING] * 2

    asyncio.run(run())


def test_reflection_lists_the_service_health_and_itself() -> None:
    async def run() -> list[str]:
        async with running_server(SERVICE) as srv:
            stub = reflection_pb2_grpc.ServerReflectionStub(srv.channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in stub.ServerReflectionInfo(iter([ask]), timeout=5):
                return sorted(s.name for s in reply.list_services_response.service)
        return []

    assert asyncio.run(run()) == sorted(
        [SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
    )
