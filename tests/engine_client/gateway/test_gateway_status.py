"""What the gateway answers for the engine's failures and state (in-process, fake engine): a
stream that fails before its first token gets the engine's status as its HTTP status (429,
503), as docs/CLIENT.md promises, not a 200 with an error event."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engine_client.gateway.api_error import ApiError
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc
from tests.gateway_fake import FakeUpstream, finished, run, token

BODIES = {
    "completions": {"prompt": "hello", "max_tokens": 4, "stream": True},
    "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "stream": True},
}
QUEUE_WAIT = ApiError(429, "waited 0.2 s in the queue", "rate_limit_error", None, "queue_full")
SERVICE_GONE = ApiError(503, "the KV service went away", "server_error", None, "unavailable")


async def _post(session: aiohttp.ClientSession, url: str, route: str, body: dict) -> tuple:
    async with session.post(f"{url.rstrip('/')}/v1/{route}", json=body) as resp:
        return resp.status, await resp.text()


@pytest.mark.parametrize("route", sorted(BODIES))
@pytest.mark.parametrize("fails", [QUEUE_WAIT, SERVICE_GONE], ids=["queue-wait", "service"])
def test_a_stream_failing_before_its_first_token_gets_the_engines_status(
    route: str, fails: ApiError
) -> None:
    upstream = FakeUpstream([finished(pb.ERROR, fails.message)], fails)
    status, text = run(upstream, lambda s, url: _post(s, url, route, BODIES[route]))
    assert status == fails.status, text
    assert json.loads(text)["error"]["message"] == fails.message


def test_a_stream_failing_after_its_first_token_ends_with_an_error_event() -> None:
    upstream = FakeUpstream([token("a"), finished(pb.ERROR, "gone")], SERVICE_GONE)
    status, text = run(upstream, lambda s, url: _post(s, url, "completions", BODIES["completions"]))
    assert status == 200
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[-2])["error"]["message"] == SERVICE_GONE.message
    assert events[-1] == "[DONE]"


async def _get(session: aiohttp.ClientSession, url: str, path: str) -> tuple:
    async with session.get(url.rstrip("/") + path) as resp:
        return resp.status, await resp.json()


def test_a_model_is_retrieved_by_its_id() -> None:
    status, model = run(FakeUpstream(), lambda s, url: _get(s, url, "/v1/models/hisparse"))
    assert (status, model["id"], model["object"]) == (200, "hisparse", "model")
    status, out = run(FakeUpstream(), lambda s, url: _get(s, url, "/v1/models/gpt-9"))
    assert (status, out["error"]["code"]) == (404, "model_not_found")


def _grpc_server(socket: str, services: dict[str, int]) -> grpc.aio.Server:
    """A server with only a health service that knows `services` (name -> status)."""
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"unix:{socket}")
    for name, status in services.items():
        asyncio.get_running_loop().create_task(health.set(name, status))
    return server


def _against(tmp_path: Path, services: dict[str, int] | None, path: str, body: dict | None):
    """(status, JSON) of GET path (body None) or POST path, to a gateway whose engine is a
    health-only gRPC server knowing `services` (None: nothing listens)."""
    socket = str(tmp_path / "peer.sock")

    async def session(s: aiohttp.ClientSession, url: str) -> tuple:
        server = _grpc_server(socket, services) if services is not None else None
        if server is not None:
            await server.start()
        try:
            if body is None:
                return await _get(s, url, path)
            async with s.post(url.rstrip("/") + path, json=body) as resp:
                return resp.status, await resp.json()
        finally:
            if server is not None:
                await server.stop(None)

    return run(None, session, target=f"unix:{socket}")


SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)


def test_health_is_the_engines(tmp_path: Path) -> None:
    engine = "decode.v1.DecodeService"
    assert _against(tmp_path, {engine: SERVING}, "/health", None)[0] == 200
    status, out = _against(tmp_path, {engine: NOT_SERVING}, "/health", None)
    assert status == 503 and "NOT_SERVING" in out["error"]["message"]
    status, out = _against(tmp_path, None, "/health", None)  # the engine is down
    assert status == 503 and out["error"]["message"]


def test_a_kv_service_as_target_is_named_not_method_not_found(tmp_path: Path) -> None:
    kv = {"kvcache.v1.KVCacheService": SERVING}
    status, out = _against(tmp_path, kv, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 502, out
    assert "KV service" in out["error"]["message"] and "--target" in out["error"]["message"]
    assert _against(tmp_path, kv, "/health", None)[0] == 503


class StoppingEngine(pb_grpc.DecodeServiceServicer):
    """An engine that fails every request with `said`, as the real one says it."""

    def __init__(self, said: str) -> None:
        self.said = said

    async def Generate(self, request, context):  # noqa: N802 (gRPC's name)
        yield finished(pb.ERROR, self.said)
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.said)


STOPPED = "the engine stopped; resume with this request id"
# A request failed with its KV service (engine_client.loop.failure): the command is the engine's.
KV_LOST = (
    "the KV service is stopping (a restart or a shutdown); resume with this request id once "
    "the engine serves again: generate --resume 0123abcd"
)


@pytest.mark.parametrize("said", [STOPPED, KV_LOST])
@pytest.mark.parametrize("stream", [False, True])
def test_the_engines_resume_advice_becomes_retry_advice(
    tmp_path: Path, stream: bool, said: str
) -> None:
    """The gateway has no resume route and its ids are not the engine's: 503, retry."""
    socket = str(tmp_path / "engine.sock")
    body = {"prompt": "x", "max_tokens": 2, "stream": stream}

    async def session(s: aiohttp.ClientSession, url: str) -> tuple:
        server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(StoppingEngine(said), server)
        server.add_insecure_port(f"unix:{socket}")
        await server.start()
        try:
            return await _post(s, url, "completions", body)
        finally:
            await server.stop(None)

    status, text = run(None, session, target=f"unix:{socket}")
    assert status == 503, text
    assert "resume" not in text and "retry the request" in text


def test_chat_without_max_tokens_asks_for_the_rest_of_the_context() -> None:
    """OpenAI's chat has no default limit (completions keep its 16): max_new_tokens 0."""
    upstream = FakeUpstream()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    run(upstream, lambda s, url: _post(s, url, "chat/completions", chat))
    run(upstream, lambda s, url: _post(s, url, "completions", {"prompt": "hi"}))
    run(upstream, lambda s, url: _post(s, url, "chat/completions", chat | {"max_tokens": 5}))
    assert [r.max_new_tokens for r in upstream.requests] == [0, 16, 5]
