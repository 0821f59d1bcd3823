"""The Session stream's own rules (`client/session_stream.py`), on a stand-in call: replies
find their requests by seq whatever their order; a missing reply, the service's end of the
stream or a refused heartbeat lose the stream at once, failing everything pending with one
error and telling the owner once; a message written after that is NotSent (safe to resend)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from contract.errors import DeadlineExceeded, InvalidArgument, KVError, ServiceUnavailable
from engine_client.client.session_stream import NotSent, SessionStream
from proto.kvcache.v1 import kvcache_pb2 as pb


class Call:
    """A bidi call: what was written, and replies the test puts in `inbox`."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.written: list[pb.SessionMessage] = []
        self.cancelled = False

    async def write(self, msg: pb.SessionMessage) -> None:
        if self.cancelled:
            raise asyncio.InvalidStateError
        self.written.append(msg)

    async def read(self):
        return await self.inbox.get()

    def cancel(self) -> None:
        self.cancelled = True

    async def done_writing(self) -> None:
        self.inbox.put_nowait(grpc.aio.EOF)


def _stream(call: Call, lost: list, timeout: float = 2.0, heartbeat=None) -> SessionStream:
    async def beat() -> None:
        if heartbeat is not None:
            raise heartbeat

    stream = SessionStream(call, timeout, 0.05, beat, lost.append)
    stream.start()
    return stream


def _ack(seq: int) -> pb.SessionReply:
    return pb.SessionReply(seq=seq, ack=pb.Ack())


def test_replies_find_their_requests_by_seq_in_any_order() -> None:
    async def run() -> list[int]:
        call, lost = Call(), []
        stream = _stream(call, lost)
        first = asyncio.ensure_future(stream.request(pb.SessionMessage(), "Commit"))
        second = asyncio.ensure_future(stream.request(pb.SessionMessage(), "Commit"))
        while len(call.written) < 2:
            await asyncio.sleep(0)
        call.inbox.put_nowait(_ack(2))
        call.inbox.put_nowait(_ack(1))
        got = [(await first).seq, (await second).seq]
        await stream.aclose()
        assert lost == [] and call.cancelled  # our own close is no loss
        return got

    assert asyncio.run(run()) == [1, 2]


def test_a_missing_reply_loses_the_stream_for_everyone_once() -> None:
    async def run() -> None:
        call, lost = Call(), []
        stream = _stream(call, lost, timeout=0.2)
        waiting = asyncio.ensure_future(stream.request(pb.SessionMessage(), "Release"))
        with pytest.raises(
            DeadlineExceeded, match="Admit: no reply from the KV service within 0.2s"
        ):
            await stream.request(pb.SessionMessage(), "Admit")
        with pytest.raises(DeadlineExceeded):
            await waiting  # the first request's deadline or the loss: one error either way
        assert not stream.open and len(lost) == 1 and call.cancelled
        with pytest.raises(NotSent):
            await stream.request(pb.SessionMessage(), "Commit")
        await stream.aclose()

    asyncio.run(run())


def test_the_service_ending_the_stream_fails_what_is_pending() -> None:
    async def run() -> KVError:
        call, lost = Call(), []
        stream = _stream(call, lost)
        pending = asyncio.ensure_future(stream.request(pb.SessionMessage(), "StepEnd"))
        while not call.written:
            await asyncio.sleep(0)
        call.inbox.put_nowait(grpc.aio.EOF)
        with pytest.raises(ServiceUnavailable) as err:
            await pending
        assert lost == [err.value]
        await stream.aclose()
        return err.value

    assert "ended the session stream" in str(asyncio.run(run()))


@pytest.mark.parametrize("refusal", [InvalidArgument("bad epoch"), ServiceUnavailable("gone")])
def test_a_refused_heartbeat_loses_the_stream_a_lost_one_leaves_it_to_the_reader(refusal) -> None:
    async def run() -> list:
        call, lost = Call(), []
        stream = _stream(call, lost, heartbeat=refusal)
        await asyncio.sleep(0.2)
        await stream.aclose()
        return lost

    lost = asyncio.run(run())
    if isinstance(refusal, ServiceUnavailable):
        assert lost == []  # the reader sees the broken stream itself
    else:
        assert len(lost) == 1 and "heartbeat refused: bad epoch" in str(lost[0])
