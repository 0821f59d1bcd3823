"""Async client of a `python -m kv_service` process: attach, map its memory, and keep one Session
stream for admit / commit / step end / release, plus the unary RemoteSwap of remote-swap mode.

Failure rules:
- every call has a deadline; a Session message unanswered within `rpc_timeout` counts as a
  lost stream;
- one reader task matches replies to requests by seq; when the stream breaks, every pending
  request fails at once with ServiceUnavailable;
- after a break the client re-attaches once with its session id. A service that is gone, or
  that restarted (new epoch, or it no longer knows the session), makes the client dead:
  `check_alive` raises, so the engine launches nothing more on the mapped memory and discards
  the step that was running. Between steps the engine then calls `let_go`, which unmaps every
  segment of the lost service (a deleted /dev/shm file stays allocated while mapped), and
  `reattach`, which waits for a service at the same address (a new epoch), attaches as a new
  session, maps its memory and points the compute at it;
- gRPC errors become typed errors through `engine_client.client.errors`: failed calls in
  `errors.rpc_errors`, in-band Error replies in `_result`;
- what Attach returns is checked and mapped in `engine_client.client.attachment`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from contract import codec, segment_map
from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.client import attachment, errors, reachability
from engine_client.client.control import (
    Admission,
    HeldRequest,
    KVStats,
    MemoryUser,
    StepReport,
)
from engine_client.client.remote_swap_call import RemoteSwapCall
from engine_client.client.session_stream import NotSent, SessionStream
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
# Between two failed re-attach attempts (doubling): a service that answers but refuses us.
REATTACH_BACKOFF = (0.1, 5.0)


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
    ) -> None:
        self.target = target
        self.engine_name = engine_name
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
        self._segments = segment_map.SegmentMap()  # what this client mapped
        self._owner_files: list[dict] = []
        self._handles: list[dict] = []
        self._mapped: KVTensors | None = None
        self._mapped_exchange: dict = {}
        self._stream: SessionStream | None = None
        self._dead: errors.KVError | None = None
        self._recover_task: asyncio.Task | None = None
        self._recovering = False
        self._closing = False

    @classmethod
    async def connect(
        cls,
        target: str,
        *,
        expected_layout: KVLayout | None = None,
        resume_session_id: str = "",
        **kwargs,
    ) -> "KVClient":
        """Attach (resuming `resume_session_id` if given), map the memory, open the stream."""
        client = cls(target, **kwargs)
        try:
            log.info(
                "connecting to the KV service at %s (waiting up to %gs)",
                target,
                client.attach_timeout,
            )
            await reachability.wait_ready(
                client._channel, reachability.KV_SERVICE, target, client.attach_timeout
            )
            reply = await client._attach(resume_session_id, expected_layout, wait=True)
            client._map(reply)
            await client._open_stream()
        except BaseException:
            await client.close()
            raise
        return client

    async def _attach(
        self, resume: str, expected: KVLayout | None, wait: bool
    ) -> pb.AttachResponse:
        req = attachment.request(self.engine_name, resume, self.with_remote_swap, expected)
        try:
            with errors.rpc_errors("Attach"):
                reply = await self._stub.Attach(
                    req, timeout=self.attach_timeout, metadata=self._metadata, wait_for_ready=wait
                )
        except errors.InvalidArgument as e:
            # The only argument the service checks at attach is our layout.
            raise errors.LayoutMismatch(e.message, e.details) from e
        layout, device = attachment.check(reply, expected)
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

    def _map(self, reply: pb.AttachResponse) -> None:
        assert self.layout is not None, "map only after an attach"
        self.tensors, self.exchange, self._owner_files = attachment.map_memory(
            reply, self.layout, self.device, self.with_remote_swap, self._segments
        )
        self._mapped, self._mapped_exchange = self.tensors, self.exchange
        self._handles = [codec.handle_from_proto(h) for h in reply.tensors]

    async def _open_stream(self) -> None:
        self._stream = SessionStream(
            self._stub.Session(metadata=self._metadata),
            self.rpc_timeout,
            self.heartbeat_interval,
            self._heartbeat,
            on_lost=self._stream_lost,
        )
        self._stream.start()
        # The first message binds the stream to the session; a heartbeat checks the round trip.
        await self._heartbeat()

    async def _heartbeat(self) -> None:
        await self._send(pb.SessionMessage(heartbeat=pb.Heartbeat()), "Heartbeat")

    def _message(self, msg: pb.SessionMessage) -> pb.SessionMessage:
        msg.session_id, msg.epoch = self.session_id, self.epoch
        return msg

    # --- loss and recovery ---

    def _stream_lost(self, why: errors.KVError) -> None:
        if self._closing or self._dead is not None:
            return
        log.warning("session stream to %s lost: %s", self.target, why)
        if self._recovering or not self._segments.is_owner_alive(self._owner_files):
            self._die(errors.ServiceUnavailable(f"KV service at {self.target} is gone: {why}"))
            return
        self._recover_task = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        """Re-attach once with the same session; anything but the same epoch means stale
        memory, and a new stream that breaks at once means the service is not usable."""
        old_epoch = self.epoch
        self._recovering = True
        try:
            await self._attach(self.session_id, self.layout, wait=False)
            if self.epoch != old_epoch:
                raise errors.EpochMismatch(f"service restarted (epoch {old_epoch} -> {self.epoch})")
            await self._open_stream()
            log.info("session %s re-attached after a stream drop", self.session_id)
        except errors.KVError as e:
            self._die(errors.ServiceUnavailable(f"KV service at {self.target} lost: {e}"))
        finally:
            self._recovering = False

    def _die(self, why: errors.KVError) -> None:
        """Dead until `reattach`. The memory is only unmapped in let_go() or close(): a step may
        still be running on it in the compute thread; the engine discards that step
        (check_alive) and launches no other."""
        if self._dead is not None:
            return
        log.error("%s; failing every request, no longer using the mapped memory", why)
        self._dead = why
        if self._stream is not None:
            self._stream.stop(why)
        self.tensors, self.exchange = None, {}

    def check_alive(self) -> None:
        """Raise ServiceUnavailable unless the service and its memory are still ours."""
        if self._dead is not None:
            raise self._dead
        if self._owner_files and not self._segments.is_owner_alive(self._owner_files):
            gone = errors.ServiceUnavailable(f"KV service at {self.target} is gone")
            self._die(gone)
            raise gone

    # --- after the service is lost: let go of it, attach to its successor ---

    def let_go(self, user: MemoryUser | None = None) -> None:
        """Unmap every segment of the service now: `user` drops its references first, then the
        client. Only while no step runs on the memory (the engine calls it between steps).
        Idempotent."""
        if self._recover_task is not None:
            self._recover_task.cancel()  # a same-session re-attach would find nothing mapped
        self._die(errors.ServiceUnavailable(f"KV service at {self.target} let go of"))
        if user is not None:
            user.bind_kv(None, {})
        self._unmap()

    def _unmap(self) -> None:
        if self._mapped is not None:
            self._segments.unmap(self._mapped)
        self._segments.unmap(self._mapped_exchange)
        self._segments.forget_files(self._handles)
        self.tensors, self.exchange, self._mapped, self._mapped_exchange = None, {}, None, {}
        self._owner_files, self._handles = [], []

    async def reattach(self, user: MemoryUser | None = None) -> None:
        """After the service was lost and let go of: wait for a service at the same address,
        attach to it as a new session, map its memory and point `user` at it. Retries with
        backoff until it succeeds (a service that is down is waited for on the channel);
        cancel the call, or close the client, to give up."""
        if self._dead is None or self._mapped is not None:
            raise RuntimeError("reattach() needs a lost service, let go of first")
        delay = REATTACH_BACKOFF[0]
        while True:
            if self._closing:
                raise errors.ServiceUnavailable(f"KV client of {self.target} closed")
            try:
                await self._attach_again()
                break
            except errors.KVError as e:
                log.warning("re-attach to %s failed: %s; next try in %.1fs", self.target, e, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, REATTACH_BACKOFF[1])
        if user is not None:
            user.bind_kv(self.tensors, self.exchange)

    async def _attach_again(self) -> None:
        old_epoch = self.epoch
        reply = await self._attach("", self.layout, wait=True)
        # A stream that breaks while it opens kills the client again (no same-session retry).
        self._recovering = True
        try:
            self._map(reply)
            self._dead = None
            await self._open_stream()
        except BaseException as e:
            self._dead = self._dead or errors.ServiceUnavailable(f"re-attach failed: {e}")
            if self._stream is not None:
                self._stream.stop(self._dead)
            self._unmap()
            raise
        finally:
            self._recovering = False
        log.info(
            "re-attached to %s as session %s: epoch %d -> %d",
            self.target,
            self.session_id,
            old_epoch,
            self.epoch,
        )

    # --- session messages ---

    def _live_stream(self) -> SessionStream:
        if self._stream is None:  # before the first attach or after a failed re-attach
            raise self._dead or errors.ServiceUnavailable("no session stream to the KV service")
        return self._stream

    async def _send(self, msg: pb.SessionMessage, what: str) -> pb.SessionReply:
        """Send on the session stream. A message the service never saw (the stream was
        already broken) is sent again once, after the re-attach."""
        await self._wait_recovered()
        try:
            reply = await self._live_stream().request(self._message(msg), what)
        except NotSent:
            if self._closing:
                raise
            await self._wait_recovered()
            reply = await self._live_stream().request(self._message(msg), what)
        return self._result(reply, what)

    async def _wait_recovered(self) -> None:
        if self._dead is not None:
            raise self._dead
        # A broken stream's loss callback runs in the same loop turn, so a recovery task exists.
        task = self._recover_task
        if (self._stream is None or not self._stream.open) and task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.attach_timeout)
            except TimeoutError:
                self._die(
                    errors.ServiceUnavailable(
                        f"KV service at {self.target}: re-attach took over {self.attach_timeout:g}s"
                    )
                )
        if self._dead is not None:
            raise self._dead

    @staticmethod
    def _result(reply: pb.SessionReply, what: str) -> pb.SessionReply:
        if reply.HasField("error"):
            e = reply.error
            if errors.status_code(e.code) is grpc.StatusCode.UNAVAILABLE:
                # In band, so the service is up: it is draining.
                raise errors.Draining(f"{what}: {e.message}", dict(e.details))
            raise errors.from_status(e.code, f"{what}: {e.message}", dict(e.details), e.reason)
        return reply

    async def admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> Admission:
        msg = pb.SessionMessage(
            admit=pb.Admit(
                request_id=request_id, prompt_len=prompt_len, max_new_tokens=max_new_tokens
            )
        )
        a = (await self._send(msg, "Admit")).admitted
        return Admission(a.request_id, a.slot, int(a.mode), a.reserved_tokens, tuple(a.pages))

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
            )
        )
        await self._send(msg, "StepEnd")

    async def release(self, request_id: str) -> None:
        await self._send(pb.SessionMessage(release=pb.Release(request_id=request_id)), "Release")

    async def stats(self) -> KVStats:
        with errors.rpc_errors("GetStats"):
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
        )

    # --- remote swap (called from the engine's compute thread) ---

    def remote_swap(
        self, layer: int, batch_size: int, rows_per_request: int = 1
    ) -> pb.RemoteSwapResponse:
        """One layer's swap-in run by the service; blocks until its outputs are final.
        rows_per_request: consecutive rows of one request sharing one plan (speculative)."""
        if self._dead is not None:
            raise self._dead
        return self._swap_call(self.session_id, self.epoch, layer, batch_size, rows_per_request)

    async def close(self, detach: bool = False) -> None:
        """Stop the stream (detaching first if asked: the service frees every request now;
        otherwise the lease keeps them for a restarted engine)."""
        if detach and self._dead is None and self._stream is not None and self._stream.open:
            with contextlib.suppress(errors.KVError, asyncio.TimeoutError):
                await self._send(pb.SessionMessage(detach=pb.Detach()), "Detach")
        self._closing = True
        if self._recover_task is not None:
            self._recover_task.cancel()
        if self._stream is not None:
            await self._stream.aclose()
        self._unmap()
        self._swap_call.close()
        await self._channel.close()
