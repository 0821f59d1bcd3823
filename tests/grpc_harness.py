"""A real in-process gRPC server on a unix socket for tests of the transport and of the client
library: the scaffold both of our servers use (`transport/grpc_server.py`), with whatever
handlers and interceptors the test gives, and an aio channel to it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1.health import aio as health_aio

from tests.service_harness import short_tmpdir
from transport import grpc_server


@dataclass
class Running:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    target: str  # unix:PATH
    channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def running_server(
    service_name: str,
    handlers: Sequence[grpc.GenericRpcHandler] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> AsyncIterator[Running]:
    """The scaffold serving `handlers` on a fresh socket; stopped and removed on exit."""
    path = os.path.join(short_tmpdir("hsg"), "s.sock")
    health = health_aio.HealthServicer()
    server = grpc_server.scaffold(service_name, health, interceptors)
    server.add_generic_rpc_handlers(tuple(handlers))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix:{path}")
    try:
        yield Running(server, health, f"unix:{path}", channel)
    finally:
        await channel.close()
        await server.stop(None)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
