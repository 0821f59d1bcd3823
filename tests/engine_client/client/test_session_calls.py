"""The session's calls (`client/session_calls.py`) on a stand-in stream and recovery: each message
carries the session and epoch, a message the service never saw is sent once more after the
re-attach, an in-band error reply is a typed error (UNAVAILABLE in band: draining), and a
Stopping reply ends the client with the service's words."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from contract import errors
from engine_client.client.control import PrefixLookup
from engine_client.client.session_calls import SessionCalls
from engine_client.client.session_stream import NotSent
from proto.kvcache.v1 import kvcache_pb2 as pb


class Stream:
    """Answers each request with the next of `replies` (an exception is raised instead)."""

    def __init__(self, *replies: pb.SessionReply | Exception) -> None:
        self.replies = list(replies)
        self.sent: list[tuple[pb.SessionMessage, str]] = []

    async def request(self, msg: pb.SessionMessage, what: str) -> pb.SessionReply:
        self.sent.append((pb.SessionMessage.FromString(msg.SerializeToString()), what))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


@dataclass
class Recovery:
    """Counts the waits for a re-attach; `next_stream` is the stream a re-attach opens."""

    calls: SessionCalls | None = None
    next_stream: Stream | None = None
    dead: errors.KVError | None = None
    waits: int = 0

    async def wait_recovered(self) -> None:
        self.waits += 1
        if self.next_stream is not None and self.calls is not None and self.waits > 1:
            self.calls.stream = self.next_stream  # type: ignore[assignment]
        if self.dead is not None:
            raise self.dead

    def die(self, why: errors.KVError) -> None:
        self.dead = self.dead or why

    def stream_lost(self, why: errors.KVError) -> None: ...


@dataclass
class Client:
    target: str = "unix:/tmp/kv.sock"
    session_id: str = "s1"
    epoch: int = 3
    rpc_timeout: float = 1.0
    heartbeat_interval: float = 1.0
    closing: bool = False
    recovery: Recovery = field(default_factory=Recovery)


def _calls(stream: Stream | None, client: Client | None = None) -> SessionCalls:
    client = client or Client()
    calls = SessionCalls(client)  # type: ignore[arg-type]
    calls.stream = stream  # type: ignore[assignment]
    client.recovery.calls = calls
    return calls


def _error(code: grpc.StatusCode, reason: str = "", message: str = "no") -> pb.SessionReply:
    return pb.SessionReply(error=pb.Error(code=code.value[0], message=message, reason=reason))


def test_messages_carry_the_session_and_replies_are_decoded() -> None:
    admitted = pb.Admitted(request_id="r", slot=2, reserved_tokens=32, pages=[5, 6])
    stream = Stream(pb.SessionReply(admitted=admitted))
    prefix = PrefixLookup(page_hashes=(b"h",), salt="x", align=16)
    got = asyncio.run(_calls(stream).admit("r", 20, 12, prefix))
    assert (got.request_id, got.slot, got.reserved_tokens, got.pages) == ("r", 2, 32, (5, 6))
    msg, what = stream.sent[0]
    assert (msg.session_id, msg.epoch, what) == ("s1", 3, "Admit")
    assert (msg.admit.prompt_len, list(msg.admit.page_hashes), msg.admit.cache_salt) == (
        20,
        [b"h"],
        "x",
    )


def test_a_message_the_service_never_saw_is_sent_again_after_the_reattach() -> None:
    client = Client()
    old, new = Stream(NotSent("broken")), Stream(pb.SessionReply(ack=pb.Ack()))
    client.recovery.next_stream = new
    asyncio.run(_calls(old, client).commit("r", 7))
    assert client.recovery.waits == 2 and len(old.sent) == len(new.sent) == 1
    assert new.sent[0][0].commit.seq_len == 7


def test_a_closing_client_does_not_resend() -> None:
    with pytest.raises(NotSent):
        asyncio.run(_calls(Stream(NotSent("broken")), Client(closing=True)).commit("r", 7))


@pytest.mark.parametrize(
    ("reply", "raised"),
    [
        (_error(grpc.StatusCode.UNAVAILABLE), errors.Draining),
        (_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED"), errors.CapacityError),
        (_error(grpc.StatusCode.NOT_FOUND, "UNKNOWN_REQUEST"), errors.UnknownRequest),
    ],
)
def test_an_in_band_error_is_a_typed_error(reply: pb.SessionReply, raised: type) -> None:
    with pytest.raises(raised, match="Release: no"):
        asyncio.run(_calls(Stream(reply)).release("r"))


def test_a_stopping_service_ends_the_client_in_its_words() -> None:
    client = Client()
    stopping = _error(grpc.StatusCode.UNAVAILABLE, errors.Stopping.reason, "drain over")
    with pytest.raises(errors.ServiceUnavailable, match="drain over"):
        asyncio.run(_calls(Stream(stopping), client).heartbeat())
    assert client.recovery.dead is not None and "unix:/tmp/kv.sock" in str(client.recovery.dead)


def test_without_a_stream_a_call_says_so() -> None:
    with pytest.raises(errors.ServiceUnavailable, match="no session stream"):
        asyncio.run(_calls(None).prefilled("r", 4))
