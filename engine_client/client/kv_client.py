"""Async client of a `python -m kv_service` process: attach, map its memory, and keep one Session
stream for admit / commit / step end / release, plus the unary RemoteSwap of remote-swap mode.
One concept: the gRPC implementation of the `KVControl` protocol (`client/control.py`); its
collaborators hold the rest (`attachment`, `mapping`, `reattach`, `session_stream`,
`remote_swap_call`).

Failure rules:
- every call has a deadline; a Session message unanswered within `rpc_timeout` counts as a
  lost stream;
- one reader task matches replies to requests by seq; when the stream breaks, every pending
  request fails at once with ServiceUnavailable;
- after a break, or once the service is lost: the client's `Reattachment`
  (`engine_client.client.reattach`: the same session again, or `let_go` of the lost memory and
  `reattach` to the successor); the mapped memory is its `Mapping` (`client.mapping`);
- gRPC errors become typed errors through `engine_client.client.status`: failed calls in
  `errors.rpc_errors`, in-band Error replies in `_result`;
- what Attach returns is checked and mapped in `engine_client.client.attachment`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from contract import errors
from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.client import address, attachment, reachability
from engine_client.client.control import (
    Admission,
    HeldRequest,
    KVStats,
    MemoryUser,
    PrefixLookup,
    StepReport,
)
from engine_client.client.mapping import Mapping
from engine_client.client.reattach import Reattachment
from engine_client.client.remote_swap_call import RemoteSwapCall
from engine_client.client.session_stream import NotSent, SessionStream
from engine_client.client.status import code_of, from_status, rpc_errors, status_code
from proto.kvcache.v1 import kvcache_pb2 as pb
from proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted service is found within a second (gRPC's default backs off to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class KVClient:
    """One engine's session with one KV service. Use `await KVClient.connect(...)`."""

    def __init__(
        self,
        target: str,
        *,
        engine_name: str,
        token: str | None = None,
        rpc_timeout: float = 5.0,
        attach_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        remote_swap: bool = False,
        model_fingerprint: str = "",
    ) -> None:
        self.target = target = address.grpc_target(target)
        self.peer = reachability.KV_SERVICE_TARGET  # who should answer at target, for errors
        self.engine_name = engine_name
        # Names the model and weights at Attach: the prefix cache's namespace (empty: off).
        self.model_fingerprint = model_fingerprint
        self.rpc_timeout = rpc_timeout
        self.attach_timeout = attach_timeout
        self.heartbeat_interval = heartbeat_interval
        self.with_remote_swap = remote_swap
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        self._swap_call = RemoteSwapCall(target, CHANNEL_OPTIONS, rpc_timeout, self._metadata)
        self.session_id = ""
        self.epoch = 0
        self.layout: KVLayout | None = None
        self.device = "cpu"  # "cpu" or "cuda:N", the service's GPU among ours
        self.tensors: KVTensors | None = None
        self.exchange: dict = {}
        self.held: tuple[HeldRequest, ...] = ()
        self.memory = Mapping(target)  # what this client mapped (tensors: None once dead)
        self.recovery = Reattachment(self)
        self._stream: SessionStream | None = None
        self.closing = False

    @classmethod
    async def connect(
        cls,
        target: str,
        *,
        expected_layout: KVLayout | None = None,
        resume_session_id: str = "",
        peer: reachability.Peer = reachability.KV_SERVICE_TARGET,
        **kwargs: Any,
    ) -> "KVClient":
        """Attach (resuming `resume_session_id` if given), map the memory, open the stream.
        `target`: a socket path, unix:PATH or HOST:PORT; `peer` words the error when nothing
        answers there (the engine's names its own flags)."""
        client = cls(target, **kwargs)
        target, client.peer = client.target, peer
        try:
            log.info(
                "connecting to the KV service at %s (waiting up to %gs)",
                target,
                client.attach_timeout,
            )
            await reachability.wait_ready(client._channel, peer, target, client.attach_timeout)
            reply = await client.attach(resume_session_id, expected_layout, wait=True)
            client.map(reply)
            await client.open_stream()
        except BaseException:
            await client.close()
            raise
        return client

    # --- the steps of connect, also the recovery's ---

    async def attach(self, resume: str, expected: KVLayout | None, wait: bool) -> pb.AttachResponse:
        req = attachment.request(
            self.engine_name, resume, self.with_remote_swap, expected, self.model_fingerprint
        )
        try:
            with rpc_errors("Attach"):
                reply = await self._stub.Attach(
                    req, timeout=self.attach_timeout, metadata=self._metadata, wait_for_ready=wait
                )
        except errors.InvalidArgument as e:
            # The only argument the service checks at attach is our layout.
            raise errors.LayoutMismatch(e.message, e.details) from e
        except errors.DeadlineExceeded as e:
            if not wait or self._channel.get_state() is grpc.ChannelConnectivity.READY:
                raise
            # wait_for_ready waited the deadline out for a connection: say what is at the path.
            raise reachability.unreachable(self.peer, self.target, self.attach_timeout) from e
        except errors.KVError as e:
            if code_of(e) is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            raise (await reachability.wrong_peer(self._channel, self.peer, self.target)) or e
        layout, device = attachment.check_reply(reply, expected)
        if self.session_id and device != self.device:
            raise errors.EpochMismatch(f"service moved from {self.device} to {device}")
        self.session_id, self.epoch, self.layout = reply.session_id, reply.epoch, layout
        self.device = device
        self.held = attachment.held_requests(reply)
        log.info(
            "attached to %s: session %s, epoch %d, %s, %d held requests",
            self.target,
            self.session_id,
            self.epoch,
            self.device,
            len(self.held),
        )
        return reply

    def map(self, reply: pb.AttachResponse) -> None:
        assert self.layout is not None, "map only after an attach"
        self.memory.map(reply, self.layout, self.device, self.with_remote_swap)
        self.tensors, self.exchange = self.memory.tensors, self.memory.exchange

    async def open_stream(self) -> None:
        self._stream = SessionStream(
            self._stub.Session(metadata=self._metadata),
            self.rpc_timeout,
            self.heartbeat_interval,
            self._heartbeat,
            on_lost=self.recovery.stream_lost,
        )
        self._stream.start()
        # The first message binds the stream to the session; a heartbeat checks the round trip.
        await self._heartbeat()

    async def _heartbeat(self) -> None:
        await self._send(pb.SessionMessage(heartbeat=pb.Heartbeat()), "Heartbeat")

    @property
    def stream_open(self) -> bool:
        return self._stream is not None and self._stream.open

    def stop_using(self, why: errors.KVError) -> None:
        """The client is dead: fail the stream's requests and hide the memory (still mapped:
        a step may run on it until let_go)."""
        if self._stream is not None:
            self._stream.stop(why)
        self.tensors, self.exchange = None, {}

    # --- loss and recovery: the client's Reattachment ---

    def check_alive(self) -> None:
        """Raise ServiceUnavailable unless the service and its memory are still ours."""
        self.recovery.check_alive()

    def let_go(self, user: MemoryUser | None = None) -> None:
        """Unmap the lost service's memory; `user` drops its references first."""
        self.recovery.let_go(user)

    async def reattach(self, user: MemoryUser | None = None) -> None:
        """Attach to the lost service's successor at the same address and map its memory."""
        await self.recovery.reattach(user)

    def _message(self, msg: pb.SessionMessage) -> pb.SessionMessage:
        msg.session_id, msg.epoch = self.session_id, self.epoch
        return msg

    # --- session messages ---

    def _live_stream(self) -> SessionStream:
        if self._stream is None:  # before the first attach or after a failed re-attach
            raise self.recovery.dead or errors.ServiceUnavailable(
                "no session stream to the KV service"
            )
        return self._stream

    async def _send(self, msg: pb.SessionMessage, what: str) -> pb.SessionReply:
        """Send on the session stream. A message the service never saw (the stream was
        already broken) is sent again once, after the re-attach."""
        await self.recovery.wait_recovered()
        try:
            reply = await self._live_stream().request(self._message(msg), what)
        except NotSent:
            if self.closing:
                raise
            await self.recovery.wait_recovered()
            reply = await self._live_stream().request(self._message(msg), what)
        if reply.error.reason == errors.Stopping.reason:
            # Its drain is over: the service stops with what it holds. Lost now, in its words,
            # not when the stream is cut under a call (gRPC then reports an internal error).
            self.recovery.die(errors.ServiceUnavailable(f"{reply.error.message} ({self.target})"))
            raise self.recovery.dead or errors.ServiceUnavailable(reply.error.message)
        return self._result(reply, what)

    @staticmethod
    def _result(reply: pb.SessionReply, what: str) -> pb.SessionReply:
        if reply.HasField("error"):
            e = reply.error
            if status_code(e.code) is grpc.StatusCode.UNAVAILABLE:
                # In band, so the service is up: it is draining.
                raise errors.Draining(f"{what}: {e.message}", dict(e.details))
            raise from_status(e.code, f"{what}: {e.message}", dict(e.details), e.reason)
        return reply

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
        a = (await self._send(pb.SessionMessage(admit=admit), "Admit")).admitted
        return Admission(
            a.request_id, a.slot, int(a.mode), a.reserved_tokens, tuple(a.pages), a.cached_tokens
        )

    async def commit(self, request_id: str, seq_len: int) -> None:
        await self._send(
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
        await self._send(msg, "StepEnd")

    async def release(self, request_id: str, page_hashes: Sequence[bytes] = ()) -> None:
        release = pb.Release(request_id=request_id, page_hashes=page_hashes)
        await self._send(pb.SessionMessage(release=release), "Release")

    async def prefilled(self, request_id: str, seq_len: int) -> None:
        """Disaggregation: a prefill engine wrote the request's first seq_len rows."""
        msg = pb.Prefilled(request_id=request_id, seq_len=seq_len)
        await self._send(pb.SessionMessage(prefilled=msg), "Prefilled")

    async def transfer_target(self) -> pb.TransferTargetResponse:
        """Disaggregation: the service's NIXL agent and regions (TRANSFER_UNSUPPORTED without)."""
        with rpc_errors("TransferTarget"):
            return await self._stub.TransferTarget(
                pb.TransferTargetRequest(), timeout=self.rpc_timeout, metadata=self._metadata
            )

    async def stats(self) -> KVStats:
        with rpc_errors("GetStats"):
            s = await self._stub.GetStats(
                pb.GetStatsRequest(), timeout=self.rpc_timeout, metadata=self._metadata
            )
        return KVStats(
            pages_used=s.host_pages.used,
            pages_total=s.host_pages.total,
            slots_used=s.request_slots.used,
            slots_total=s.request_slots.total,
            requests=s.requests,
            hits=s.hits,
            misses=s.misses,
            bytes_moved=s.bytes_moved,
            cached_pages=s.cached_pages,
            evictable_pages=s.evictable_pages,
        )

    async def flush(self) -> tuple[int, int]:
        """Admin: empty the service's prefix cache; (pages freed, cached pages in use)."""
        with rpc_errors("Flush"):
            r = await self._stub.Flush(
                pb.FlushRequest(), timeout=self.rpc_timeout, metadata=self._metadata
            )
        return r.pages_freed, r.pages_in_use

    # --- remote swap (called from the engine's compute thread) ---

    def remote_swap(
        self, layer: int, batch_size: int, rows_per_request: int = 1
    ) -> pb.RemoteSwapResponse:
        """One layer's swap-in run by the service; blocks until its outputs are final.
        rows_per_request: consecutive rows of one request sharing one plan (speculative)."""
        if self.recovery.dead is not None:
            raise self.recovery.dead
        return self._swap_call(self.session_id, self.epoch, layer, batch_size, rows_per_request)

    async def close(self, detach: bool = False) -> None:
        """Stop the stream (detaching first if asked: the service frees every request now;
        otherwise the lease keeps them for a restarted engine)."""
        if detach and self.recovery.dead is None and self.stream_open:
            with contextlib.suppress(errors.KVError, asyncio.TimeoutError):
                await self._send(pb.SessionMessage(detach=pb.Detach()), "Detach")
        self.closing = True
        self.recovery.cancel()
        if self._stream is not None:
            await self._stream.aclose()
        self.memory.unmap()
        self.tensors, self.exchange = None, {}
        self._swap_call.close()
        await self._channel.close()
