"""The gateway's side of gRPC: one channel to the engine, Generate streams whose failures come
back as ApiError (decoded by the client library's errors module, mapped by api_error)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import grpc

from engine_client.client import errors
from engine_client.gateway.api_error import ApiError
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

# Streams of many HTTP clients go round-robin over a few channels, each its own connection
# (own subchannel pool), as bench/e2e_load.py spreads its streams: one HTTP/2 connection
# carrying hundreds of streams is served by one thread of the engine's gRPC core.
CHANNELS = 4
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


class Upstream:
    def __init__(self, target: str, timeout: float) -> None:
        self.target, self.timeout = target, timeout
        self.channels = [
            grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(CHANNELS)
        ]
        self.stubs = [pb_grpc.DecodeServiceStub(ch) for ch in self.channels]
        self._next = 0

    async def generate(
        self, request: pb.GenerateRequest
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The engine's responses. Leaving the iteration early (the HTTP client went away, or
        its handler was cancelled) cancels the call: the engine cancels the request and frees
        its KV."""
        self._next = (self._next + 1) % len(self.stubs)
        call = self.stubs[self._next].Generate(request, timeout=self.timeout)
        try:
            with errors.rpc_errors("Generate"):
                async for resp in call:
                    yield resp
        except errors.KVError as e:
            raise ApiError.from_engine(e) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
