"""The gateway's aiohttp application in-process, over a fake engine: tests of what the gateway
itself decides (request checks, HTTP statuses, health) without starting any process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import test_utils

from engine_client.gateway.api_error import ApiError
from engine_client.gateway.app import Gateway
from engine_client.gateway.config import GatewayConfig
from proto.decode.v1 import decode_pb2 as pb


def token(text: str, index: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r1", token_id=7, index=index, has_token=True, text=text)


def finished(reason: int = pb.LENGTH, message: str = "") -> pb.GenerateResponse:
    usage = pb.Usage(prompt_tokens=3, generated_tokens=1)
    return pb.GenerateResponse(
        request_id="r1", finished=True, finish_reason=reason, error_message=message, usage=usage
    )


@dataclass
class FakeUpstream:
    """Answers every Generate with `script`: responses, then the ApiError `fails` if set (as the
    real upstream raises the engine's gRPC status after the stream's last response)."""

    script: list[pb.GenerateResponse] = field(default_factory=lambda: [token("hi"), finished()])
    fails: ApiError | None = None
    serving: bool = True
    requests: list[pb.GenerateRequest] = field(default_factory=list)

    async def generate(self, request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse]:
        self.requests.append(request)
        for resp in self.script:
            yield resp
        if self.fails is not None:
            raise self.fails

    async def health(self) -> None:
        if not self.serving:
            raise ApiError(503, "the engine is not serving", "server_error", None, "unhealthy")

    async def close(self) -> None:
        pass


Session = Callable[[aiohttp.ClientSession, str], Awaitable[Any]]


def run(upstream: FakeUpstream | None, body: Session, **cfg: Any) -> Any:
    """body(session, base URL) against a gateway over `upstream` (None: its real one, to
    cfg["target"]), in a fresh event loop."""

    async def main() -> Any:
        gateway = Gateway(GatewayConfig(**({"target": "unix:/nonexistent"} | cfg)))
        if upstream is not None:
            await gateway.upstream.close()
            gateway.upstream = upstream  # type: ignore[assignment]
        server = test_utils.TestServer(gateway.app(), handler_cancellation=True)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                return await body(session, str(server.make_url("")))
        finally:
            await server.close()

    return asyncio.run(main())
