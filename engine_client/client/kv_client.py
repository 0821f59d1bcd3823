"""Async client of a `python -m kv_service` process: attach, map its memory, and keep one Session
stream for admit / commit / step end / release, plus the unary RemoteSwap of remote-swap mode.
One concept: the gRPC implementation of the `KVControl` protocol (`client/control.py`), as the
life of one connection: connect (attach, map, open the session), the unary calls, close. Its
collaborators hold the rest: what Attach returns is checked and mapped in `attachment` and
`mapping`; the session's messages travel in `session_calls` (on a `session_stream`); a lost
stream or service is the client's `Reattachment` (`reattach`: the same session again, or
`let_go` of the lost memory and `reattach` to the successor); RemoteSwap is `remote_swap_call`.

Every call has a deadline; gRPC errors become typed errors through
`engine_client.client.status` (failed calls in `errors.rpc_errors`).
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
from engine_client.client.session_calls import SessionCalls
from engine_client.client.status import rpc_errors
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
        self.session = SessionCalls(self)
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
        reply = await attachment.call(
            self._channel,
            req,
            target=self.target,
            peer=self.peer,
            timeout=self.attach_timeout,
            metadata=self._metadata,
            wait=wait,
        )
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
        await self.session.open(self._stub.Session(metadata=self._metadata))

    @property
    def stream_open(self) -> bool:
        return self.session.open_now

    def stop_using(self, why: errors.KVError) -> None:
        """The client is dead: fail the stream's requests and hide the memory (still mapped:
        a step may run on it until let_go)."""
        self.session.stop(why)
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

    # --- the data path: the session's messages (session_calls) ---

    async def admit(
        self,
        request_id: str,
        prompt_len: int,
        max_new_tokens: int,
        prefix: PrefixLookup | None = None,
    ) -> Admission:
        return await self.session.admit(request_id, prompt_len, max_new_tokens, prefix)

    async def commit(self, request_id: str, seq_len: int) -> None:
        await self.session.commit(request_id, seq_len)

    async def step_end(self, report: StepReport) -> None:
        await self.session.step_end(report)

    async def release(self, request_id: str, page_hashes: Sequence[bytes] = ()) -> None:
        await self.session.release(request_id, page_hashes)

    async def prefilled(self, request_id: str, seq_len: int) -> None:
        """Disaggregation: a prefill engine wrote the request's first seq_len rows."""
        await self.session.prefilled(request_id, seq_len)

    # --- unary calls ---

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
                await self.session.detach()
        self.closing = True
        self.recovery.cancel()
        await self.session.aclose()
        self.memory.unmap()
        self.tensors, self.exchange = None, {}
        self._swap_call.close()
        await self._channel.close()
