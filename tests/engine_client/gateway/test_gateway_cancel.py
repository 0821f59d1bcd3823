"""A gateway request whose client is gone is cancelled in the engine (in-process gateway, a fake
engine over gRPC): the HTTP client disconnects (stream or not), or the engine stops under the
request (SIGTERM with a state file, or killed) and would resume it after its restart for no
client: the gateway cancels it there once the engine serves again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc
from tests.gateway_fake import finished, run, token

ENGINE = "decode.v1.DecodeService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STOPPED = "the engine stopped; resume with this request id"
RESTART_S = 0.5  # how long the fake engine is NOT_SERVING after it stopped


class FakeEngine(pb_grpc.DecodeServiceServicer):
    """Answers a new request by `how`; a resumed one by following it until the client cancels.
    Records the resumes (with whether it was serving then) and the calls its clients
    cancelled."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.health = health_aio.HealthServicer()
        self.serving = True
        self.resumes: list[tuple[str, bool]] = []
        self.cancelled: list[str] = []

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        await self.health.set(ENGINE, SERVING if serving else NOT_SERVING)

    async def _restart(self) -> None:
        await self.set_serving(False)
        await asyncio.sleep(RESTART_S)
        await self.set_serving(True)

    async def Generate(self, request, context):  # noqa: N802 (gRPC's name)
        rid = request.resume_request_id or "r1"
        await context.send_initial_metadata((("request-id", rid),))
        try:
            if request.resume_request_id:
                self.resumes.append((rid, self.serving))
                await asyncio.sleep(3600)
            if self.how == "kill":  # in the prefill: the id only in the initial metadata
                asyncio.get_running_loop().create_task(self._restart())
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            yield token("a")
            if self.how == "slow":
                while True:
                    await asyncio.sleep(0.02)
                    yield token("b")
            if self.how == "stop":  # as engine.stop(keep_requests=True) ends a request
                asyncio.get_running_loop().create_task(self._restart())
                yield finished(pb.ERROR, STOPPED)
            if self.how == "queue":  # a failure the engine ended itself: nothing to cancel
                yield finished(pb.ERROR, "waited too long")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "waited too long")
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPED)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


def _with_engine(tmp_path: Path, engine: FakeEngine, client) -> None:
    """client(session, gateway URL) against a gateway in front of `engine`."""
    socket = str(tmp_path / "engine.sock")

    async def session(s: aiohttp.ClientSession, url: str) -> None:
        server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(engine, server)
        health_pb2_grpc.add_HealthServicer_to_server(engine.health, server)
        server.add_insecure_port(f"unix:{socket}")
        await engine.set_serving(True)
        await server.start()
        try:
            await client(s, url.rstrip("/") + "/v1/completions")
        finally:
            await server.stop(None)

    run(None, session, target=f"unix:{socket}", timeout=30.0)


async def _until(check, seconds: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check() and loop.time() < deadline:
        await asyncio.sleep(0.02)


BODY = {"prompt": "x", "max_tokens": 100}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_goes_away_cancels_its_request(tmp_path: Path, stream: bool) -> None:
    engine = FakeEngine("slow")

    async def client(s: aiohttp.ClientSession, url: str) -> None:
        if stream:
            async with s.post(url, json=BODY | {"stream": True}) as r:
                assert (await r.content.readline()).startswith(b"data: {")
        else:  # the answer never comes: the client gives up
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(s.post(url, json=BODY), 0.3)
        await _until(lambda: engine.cancelled)
        assert engine.cancelled == ["r1"]

    _with_engine(tmp_path, engine, client)


@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_cut_by_an_engine_stop_is_cancelled_after_its_restart(
    tmp_path: Path, how: str, stream: bool
) -> None:
    engine = FakeEngine(how)

    async def client(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url, json=BODY | {"stream": stream}) as r:
            text = await r.text()
        assert "resume" not in text and ("retry the request" in text or how == "kill"), text
        await _until(lambda: engine.cancelled)
        # Attached once the engine served again, then cancelled: as a client that goes away.
        assert engine.resumes == [("r1", True)] and engine.cancelled == ["r1"]

    _with_engine(tmp_path, engine, client)


def test_a_request_the_engine_ended_itself_is_left_alone(tmp_path: Path) -> None:
    engine = FakeEngine("queue")

    async def client(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url, json=BODY | {"stream": True}) as r:
            assert "waited too long" in await r.text()
        await asyncio.sleep(RESTART_S)
        assert engine.resumes == [] and engine.cancelled == []

    _with_engine(tmp_path, engine, client)
