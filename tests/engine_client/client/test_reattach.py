"""What a client does when its service is lost (`client/reattach.py`), on a stand-in client:
a dropped stream is retried once in the same session; a service that restarted or is gone makes
the client dead (`check_alive` raises); `let_go` drops the memory user's views, then the
client's; `reattach` retries until a successor takes it, then points the user at the new
memory."""

from __future__ import annotations

import asyncio

import pytest

from contract.errors import KVError, ServiceUnavailable, UnknownSession
from engine_client.client import reattach
from engine_client.client.reattach import Reattachment
from proto.kvcache.v1 import kvcache_pb2 as pb


class Memory:
    def __init__(self) -> None:
        self.alive, self.mapped, self.unmapped, self.counters_cleaned = True, True, 0, 0

    def owner_alive(self) -> bool:
        return self.alive

    def unmap(self) -> list[dict]:
        self.unmapped += 1
        self.mapped = False
        return []

    def remove_stale_counters(self) -> None:
        self.counters_cleaned += 1


class Client:
    """The KVClient side the recovery uses; `answers` are what successive attaches do."""

    def __init__(self, *answers: int | KVError) -> None:
        self.target, self.session_id, self.layout = "unix:/kv.sock", "s1", None
        self.epoch, self.attach_timeout, self.closing = 1, 2.0, False
        self.memory, self.tensors, self.exchange = Memory(), None, {}
        self.answers, self.attached, self.streams, self.stopped = list(answers), [], 0, []
        self.stream_open = True

    async def attach(self, resume: str, expected, wait: bool) -> pb.AttachResponse:
        self.attached.append(resume)
        answer = self.answers.pop(0)
        if isinstance(answer, KVError):
            raise answer
        self.epoch = answer
        return pb.AttachResponse(epoch=answer)

    def map(self, reply: pb.AttachResponse) -> None:
        self.memory.mapped, self.tensors = True, f"tensors of epoch {reply.epoch}"

    async def open_stream(self) -> None:
        self.streams += 1
        self.stream_open = True

    def stop_using(self, why: KVError) -> None:
        self.stopped.append(why)


class User:
    def __init__(self) -> None:
        self.bound: list[object] = []

    def bind_kv(self, tensors, exchange: dict) -> None:
        self.bound.append(tensors)


def _drop(client: Client, answer_epoch: int | KVError) -> Reattachment:
    """Lose the stream once, with the service's next attach answer queued."""
    client.answers.append(answer_epoch)
    client.stream_open = False
    r = Reattachment(client)
    r.stream_lost(ServiceUnavailable("stream broke"))
    return r


def test_a_dropped_stream_resumes_the_same_session() -> None:
    async def run() -> Client:
        client = Client()
        r = _drop(client, 1)
        await r.wait_recovered()
        r.check_alive()
        return client

    client = asyncio.run(run())
    assert client.attached == ["s1"] and client.streams == 1 and client.stopped == []


@pytest.mark.parametrize(
    "answer", [2, UnknownSession("unknown session s1")], ids=["restarted", "forgot"]
)
def test_a_service_that_restarted_or_forgot_us_makes_the_client_dead(answer) -> None:
    async def run() -> Client:
        client = Client()
        r = _drop(client, answer)
        with pytest.raises(ServiceUnavailable, match="lost"):
            await r.wait_recovered()
        with pytest.raises(ServiceUnavailable):
            r.check_alive()
        return client

    client = asyncio.run(run())
    assert len(client.stopped) == 1 and client.streams == 0
    why = "service restarted (epoch 1 -> 2)" if answer == 2 else "unknown session s1"
    assert why in str(client.stopped[0])


def test_a_gone_owner_is_dead_at_once_without_a_retry() -> None:
    async def run() -> Client:
        client = Client()
        client.memory.alive = False
        r = Reattachment(client)
        r.stream_lost(ServiceUnavailable("stream broke"))
        with pytest.raises(ServiceUnavailable, match="is gone"):
            r.check_alive()
        return client

    assert asyncio.run(run()).attached == []


def test_let_go_then_reattach_to_a_successor(monkeypatch) -> None:
    monkeypatch.setattr(reattach, "REATTACH_BACKOFF", (0.01, 0.02))

    async def run() -> tuple[Client, User]:
        client, user = Client(ServiceUnavailable("not up yet"), 7), User()
        r = Reattachment(client)
        with pytest.raises(RuntimeError):
            await r.reattach(user)  # nothing was lost
        r.let_go(user)
        r.let_go(user)  # idempotent: unmapping twice is harmless
        with pytest.raises(ServiceUnavailable, match="let go of"):
            r.check_alive()
        await r.reattach(user)
        r.check_alive()
        return client, user

    client, user = asyncio.run(run())
    assert user.bound == [None, None, "tensors of epoch 7"]  # views dropped, then the new memory
    assert client.attached == ["", ""] and client.epoch == 7  # new sessions, not "s1"
    assert client.memory.counters_cleaned == 1 and client.streams == 1
