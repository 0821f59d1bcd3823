"""What the gateway answers for the engine's failures and state (in-process, fake engine): a
stream that fails before its first token gets the engine's status as its HTTP status (429,
503), as docs/CLIENT.md promises, not a 200 with an error event."""

from __future__ import annotations

import json

import aiohttp
import pytest

from engine_client.gateway.api_error import ApiError
from proto.decode.v1 import decode_pb2 as pb
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
