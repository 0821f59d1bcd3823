"""The data path of a `KVClient`: the control protocol's calls that travel on the session's
Session stream (admit, commit, step end, release, prefilled, heartbeat, detach), each stamped
with the session and epoch and answered in band.

Failure rules:
- a message waits for a stream drop's re-attach to end (the client's `Reattachment`); one the
  service never saw (the stream was already broken) is sent again once, on the new stream;
- an in-band Error reply becomes a typed error (`engine_client.client.status`): UNAVAILABLE
  means the service is up and draining (`Draining`); a Stopping reply means its drain is over,
  and the client dies with the service's words;
- the stream itself (`session_stream.SessionStream`) fails every pending request at once when
  it breaks, and tells the recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grpc

from contract import errors
from engine_client.client.control import Admission, PrefixLookup, StepReport
from engine_client.client.reattach import Reattachment
from engine_client.client.session_stream import NotSent, SessionStream
from engine_client.client.status import from_status, status_code
from proto.kvcache.v1 import kvcache_pb2 as pb


class Client(Protocol):
    """What the session's calls read of their KVClient: the session they belong to."""

    target: str
    session_id: str
    epoch: int
    rpc_timeout: float
    heartbeat_interval: float
    closing: bool
    recovery: Reattachment


def _result(reply: pb.SessionReply, what: str) -> pb.SessionReply:
    if reply.HasField("error"):
        e = reply.error
        if status_code(e.code) is grpc.StatusCode.UNAVAILABLE:
            # In band, so the service is up: it is draining.
            raise errors.Draining(f"{what}: {e.message}", dict(e.details))
        raise from_status(e.code, f"{what}: {e.message}", dict(e.details), e.reason)
    return reply


class SessionCalls:
    """The Session stream of `client`'s current session (a new one after each attach) and the
    protocol's messages on it."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.stream: SessionStream | None = None

    async def open(self, call: grpc.aio.StreamStreamCall) -> None:
        """Run the Session stream `call` of a new attach: the first message binds it to the
        session, a heartbeat checks the round trip."""
        c = self.client
        self.stream = SessionStream(
            call, c.rpc_timeout, c.heartbeat_interval, self.heartbeat, c.recovery.stream_lost
        )
        self.stream.start()
        await self.heartbeat()

    @property
    def open_now(self) -> bool:
        return self.stream is not None and self.stream.open

    def stop(self, why: errors.KVError) -> None:
        """Fail the stream's pending requests with `why`."""
        if self.stream is not None:
            self.stream.stop(why)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()

    def _live_stream(self) -> SessionStream:
        if self.stream is None:  # before the first attach or after a failed re-attach
            raise self.client.recovery.dead or errors.ServiceUnavailable(
                "no session stream to the KV service"
            )
        return self.stream

    def _stamped(self, msg: pb.SessionMessage) -> pb.SessionMessage:
        msg.session_id, msg.epoch = self.client.session_id, self.client.epoch
        return msg

    async def send(self, msg: pb.SessionMessage, what: str) -> pb.SessionReply:
        """Send on the session stream. A message the service never saw (the stream was
        already broken) is sent again once, after the re-attach."""
        c = self.client
        await c.recovery.wait_recovered()
        try:
            reply = await self._live_stream().request(self._stamped(msg), what)
        except NotSent:
            if c.closing:
                raise
            await c.recovery.wait_recovered()
            reply = await self._live_stream().request(self._stamped(msg), what)
        if reply.error.reason == errors.Stopping.reason:
            # Its drain is over: the service stops with what it holds. Lost now, in its words,
            # not when the stream is cut under a call (gRPC then reports an internal error).
            c.recovery.die(errors.ServiceUnavailable(f"{reply.error.message} ({c.target})"))
            raise c.recovery.dead or errors.ServiceUnavailable(reply.error.message)
        return _result(reply, what)

    async def heartbeat(self) -> None:
        await self.send(pb.SessionMessage(heartbeat=pb.Heartbeat()), "Heartbeat")

    async def detach(self) -> None:
        await self.send(pb.SessionMessage(detach=pb.Detach()), "Detach")

    async def admit(
        self,
        request_id: str,
        prompt_len: int,
        max_new_tokens: int,
        prefix: PrefixLookup | None = None,
    ) -> Admission:
        admit = pb.Admit(
            request_id=request_id, prompt_len=prompt_len, max_new_tokens=max_new_tokens
        )
        if prefix is not None:
            admit.page_hashes.extend(prefix.page_hashes)
            admit.cache_salt, admit.reuse_align = prefix.salt, prefix.align
        a = (await self.send(pb.SessionMessage(admit=admit), "Admit")).admitted
        return Admission(
            a.request_id, a.slot, int(a.mode), a.reserved_tokens, tuple(a.pages), a.cached_tokens
        )

    async def commit(self, request_id: str, seq_len: int) -> None:
        await self.send(
            pb.SessionMessage(commit=pb.Commit(request_id=request_id, seq_len=seq_len)), "Commit"
        )

    async def step_end(self, report: StepReport) -> None:
        progress = [pb.RequestProgress(request_id=r, seq_len=n) for r, n in report.progress]
        msg = pb.SessionMessage(
            step_end=pb.StepEnd(
                step=report.step,
                progress=progress,
                hits=report.hits,
                misses=report.misses,
                bytes_moved=report.bytes_moved,
                steps=report.steps,
            )
        )
        await self.send(msg, "StepEnd")

    async def release(self, request_id: str, page_hashes: Sequence[bytes] = ()) -> None:
        release = pb.Release(request_id=request_id, page_hashes=page_hashes)
        await self.send(pb.SessionMessage(release=release), "Release")

    async def prefilled(self, request_id: str, seq_len: int) -> None:
        """Disaggregation: a prefill engine wrote the request's first seq_len rows."""
        msg = pb.Prefilled(request_id=request_id, seq_len=seq_len)
        await self.send(pb.SessionMessage(prefilled=msg), "Prefilled")
