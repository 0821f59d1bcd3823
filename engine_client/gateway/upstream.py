"""The gateway's side of gRPC: one channel to the engine, Generate streams whose failures come
back as ApiError (decoded by the client library's errors module, mapped by api_error)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract import errors
from engine_client.client import reachability
from engine_client.client.status import code_of, rpc_errors
from engine_client.gateway import orphans
from engine_client.gateway.api_error import ApiError
from engine_client.gateway.orphans import Orphans
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

# Streams of many HTTP clients go round-robin over a few channels, each its own connection
# (own subchannel pool), as bench/e2e/load.py spreads its streams: one HTTP/2 connection
# carrying hundreds of streams is served by one thread of the engine's gRPC core.
CHANNELS = 4
# A restarted engine is reached at once: gRPC's default reconnect backoff grows to 120 s, so
# answers would stay 503 long after the engine is back, and the requests it restored for no
# client (orphans) would decode on until the channel tried again. An attempt every 250 ms to
# an address that does not answer costs nothing.
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
]
ENGINE_SERVICE = "decode.v1.DecodeService"
HEALTH_TIMEOUT = 2.0  # a health probe's answer: compose polls it every few seconds
# The engine's advice when it stops mid-request. The gateway's ids are not the engine's and it
# has no resume route: its client should retry the request instead (503 is retryable).
ENGINE_RESUME_ADVICE = "resume with this request id"


class Upstream:
    def __init__(self, target: str, timeout: float) -> None:
        self.target, self.timeout = target, timeout
        self.channels = [
            grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(CHANNELS)
        ]
        self.stubs = [pb_grpc.DecodeServiceStub(ch) for ch in self.channels]
        self._next = 0
        self.orphans = Orphans(self.channels[0], ENGINE_SERVICE, timeout)

    async def generate(
        self, request: pb.GenerateRequest
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The engine's responses. Leaving the iteration early (the HTTP client went away, or
        its handler was cancelled) cancels the call: the engine cancels the request and frees
        its KV. A call cut by the engine's stop leaves the request to a restarted engine: it is
        cancelled there (orphans)."""
        self._next = (self._next + 1) % len(self.stubs)
        channel = self.channels[self._next]
        call = self.stubs[self._next].Generate(request, timeout=self.timeout)
        # ended: the last response came; stopped: it said the engine keeps the request.
        rid, ended, stopped = "", False, False
        try:
            with rpc_errors("Generate"):
                async for resp in call:
                    rid, ended = resp.request_id, resp.finished
                    if resp.finished and ENGINE_RESUME_ADVICE in resp.error_message:
                        stopped = True
                        resp.error_message = _retry_advice(resp.error_message)
                    yield resp
        except errors.KVError as e:
            # UNAVAILABLE without a last response: the connection broke (the engine was killed).
            if not ended and code_of(e) is grpc.StatusCode.UNAVAILABLE:
                rid = rid or await orphans.request_id(call)
                stopped = bool(rid)
            raise await self._api_error(channel, e) from None
        finally:
            call.cancel()
            if stopped:
                self.orphans.cancel(rid)

    async def _api_error(self, channel: grpc.aio.Channel, e: errors.KVError) -> ApiError:
        if code_of(e) is grpc.StatusCode.UNIMPLEMENTED:  # not an engine's address?
            wrong = await reachability.wrong_peer(channel, reachability.ENGINE, self.target)
            what = str(wrong) if wrong is not None else f"{self.target} is not an engine: {e}"
            return ApiError(502, f"the gateway's --target is wrong: {what}", "server_error")
        err = ApiError.from_engine(e)
        err.message = _retry_advice(err.message)
        return err

    async def health(self) -> None:
        """Returns if the engine answers SERVING; else ApiError 503 saying why."""
        stub = health_pb2_grpc.HealthStub(self.channels[0])
        check = health_pb2.HealthCheckRequest(service=ENGINE_SERVICE)
        try:
            resp = await stub.Check(check, timeout=HEALTH_TIMEOUT)
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}"
            raise ApiError(503, f"the engine at {self.target}: {why}", "server_error") from None
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            raise ApiError(503, f"the engine at {self.target} is {status}", "server_error")

    async def close(self) -> None:
        await self.orphans.close()
        for ch in self.channels:
            await ch.close()


def _retry_advice(message: str) -> str:
    """The engine's advice, and what follows it (its resume command), are for its own clients."""
    head, advice, _ = message.partition(ENGINE_RESUME_ADVICE)
    return head + "retry the request" if advice else message
