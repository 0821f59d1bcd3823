"""KVCacheService over gRPC, one concept: the translation between proto messages and ServiceCore.

Unary RPCs raise typed errors that the interceptor maps; the Session stream maps each message's
error into an in-band Error reply (same mapping) so one bad message does not end the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from contract.codec import handle_to_proto, layout_from_proto, layout_to_proto, target_to_proto
from contract.errors import InvalidArgument, ServiceUnavailable, Stopping, TransferUnsupported
from contract.nixl_agent import NixlAgent
from contract.transfer_target import TransferTarget
from kv_service.core import ServiceCore
from kv_service.memory.region_lease import RegionLease
from kv_service.memory.remote_swap import RemoteSwapper
from kv_service.rpc.metrics import ServiceMetrics
from kv_service.rpc.replies import admitted, request_to_proto, stats_to_proto
from proto.kvcache.v1 import kvcache_pb2 as pb
from proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from transport.status import status_of

CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@dataclass
class Runtime:
    """What exists once memory is allocated."""

    core: ServiceCore
    handles: list[dict]
    swapper: RemoteSwapper
    exchange_handles: list[dict]
    region: RegionLease
    device: str
    gpu_uuid: str
    instance: str
    # Disaggregation (--nixl): the NIXL agent and its target, None without one.
    agent: NixlAgent | None = None
    transfer: TransferTarget | None = None


def _export_planning(
    rt: Runtime, session_id: str, remote_swap: bool, reply: pb.AttachResponse
) -> None:
    """The tensors a session plans with beyond the KV tensors. The shared hot region is
    planned by the session that holds it (kv_service.memory.region_lease): in its engine (the
    tensors go to it alone) or, with remote swap, here, where a re-attach empties it (whatever
    its engine was doing when it went, nothing of the region is in flight here)."""
    if rt.region.grant(session_id):
        if remote_swap:
            rt.region.empty()
        else:
            reply.tensors.extend(handle_to_proto(h) for h in rt.region.handles)
    if remote_swap:
        rt.swapper.claim(session_id)
        reply.tensors.extend(handle_to_proto(h) for h in rt.exchange_handles)
        reply.events.extend(
            pb.EventHandle(name=n, ipc_handle=h) for n, h in rt.swapper.event_handles()
        )


def error_to_proto(exc: BaseException) -> pb.Error:
    status = status_of(exc)
    return pb.Error(
        code=status.code.value[0],
        message=status.message,
        details=status.details,
        reason=status.reason,
    )


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, metrics: ServiceMetrics, on_drain: Callable[[], Awaitable[None]]) -> None:
        self._rt: Runtime | None = None
        self._metrics = metrics
        self._on_drain = on_drain
        # Set whenever requests may have been freed; drains wait on it.
        self.changed = asyncio.Event()
        self.stopping = ""  # once the drain is over: why every session message is refused

    def ready(self, runtime: Runtime) -> None:
        self._rt = runtime

    @property
    def rt(self) -> Runtime:
        if self._rt is None:
            raise ServiceUnavailable("the service is starting: memory is not allocated yet")
        return self._rt

    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttachResponse:
        rt = self.rt
        expected = (
            layout_from_proto(request.expected_layout)
            if request.HasField("expected_layout")
            else None
        )
        if request.remote_swap:
            # Refuse before creating a session that nobody would then use.
            rt.swapper.check_free(request.resume_session_id)
        session = rt.core.attach(
            request.engine_name, request.resume_session_id, expected, request.model_fingerprint
        )
        reply = pb.AttachResponse(
            session_id=session.session_id,
            lease_seconds=rt.core.lease_seconds,
            epoch=rt.core.epoch,
            layout=layout_to_proto(rt.core.layout),
            gpu_uuid=rt.gpu_uuid,
            device=rt.device,
            instance=rt.instance,
            tensors=[handle_to_proto(h) for h in rt.handles],
            requests=[request_to_proto(r) for r in session.requests.values()],
        )
        _export_planning(rt, session.session_id, request.remote_swap, reply)
        return reply

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionReply]:
        bound: list[str] = []
        try:
            async for msg in request_iterator:
                started = time.perf_counter()
                reply, done = self._answer(msg, bound)
                code = (
                    CODE_NAMES.get(reply.error.code, "UNKNOWN") if reply.HasField("error") else "OK"
                )
                self._metrics.observe_message(
                    str(msg.WhichOneof("body")), code, time.perf_counter() - started
                )
                yield reply
                if done:
                    return
        finally:
            if bound and self._rt is not None:
                self._rt.core.table.stream_closed(bound[0])
            self.changed.set()

    def _answer(self, msg: pb.SessionMessage, bound: list[str]) -> tuple[pb.SessionReply, bool]:
        """Reply to one message; `bound` holds the session this stream belongs to, once known."""
        kind = msg.WhichOneof("body")
        try:
            if self.stopping:  # a typed answer, where the stream's end would lose its code
                raise Stopping(self.stopping)
            core = self.rt.core
            core.check_epoch(msg.epoch)
            if not bound:
                core.table.stream_opened(msg.session_id)
                bound.append(msg.session_id)
            elif msg.session_id != bound[0]:
                raise InvalidArgument(
                    "this stream belongs to another session; open one stream per session",
                    stream_session=bound[0],
                )
            result = self._dispatch(core, kind, msg)
        except Exception as exc:
            return pb.SessionReply(seq=msg.seq, error=error_to_proto(exc)), False
        if kind == "detach":
            bound.clear()
        if isinstance(result, pb.Admitted):
            return pb.SessionReply(seq=msg.seq, admitted=result), False
        return pb.SessionReply(seq=msg.seq, ack=pb.Ack(draining=core.draining)), kind == "detach"

    def _dispatch(
        self, core: ServiceCore, kind: str | None, msg: pb.SessionMessage
    ) -> pb.Admitted | None:
        sid = msg.session_id
        if kind == "admit":
            return admitted(core, sid, msg.admit)
        if kind == "commit":
            core.commit(sid, msg.commit.request_id, msg.commit.seq_len)
        elif kind == "step_end":
            s = msg.step_end
            core.step_end(
                sid,
                [(p.request_id, p.seq_len) for p in s.progress],
                s.hits,
                s.misses,
                s.bytes_moved,
                s.steps or 1,  # unset by engines that never merge
            )
        elif kind == "release":
            core.release(sid, msg.release.request_id, msg.release.page_hashes)
            self.changed.set()
        elif kind == "prefilled":
            core.prefilled(sid, msg.prefilled.request_id, msg.prefilled.seq_len)
        elif kind == "heartbeat":
            core.table.touch(sid)
        elif kind == "detach":
            core.detach(sid)
            self.changed.set()
        else:
            raise InvalidArgument(
                "empty SessionMessage: set one of admit, commit, step_end, "
                "release, heartbeat, detach, prefilled"
            )
        return None

    async def RemoteSwap(
        self, request: pb.RemoteSwapRequest, context: grpc.aio.ServicerContext
    ) -> pb.RemoteSwapResponse:
        rt = self.rt
        rt.core.check_epoch(request.epoch)
        session = rt.core.table.touch(request.session_id)
        result = rt.swapper.run(
            session.session_id,
            request.layer,
            request.batch_size,
            {r.slot for r in session.requests.values()},
            request.rows_per_request or 1,
        )
        self._metrics.swap_seconds.observe(result.seconds)
        return pb.RemoteSwapResponse(
            hits=result.hits,
            misses=result.misses,
            bytes_moved=result.bytes_moved,
            service_us=result.seconds * 1e6,
        )

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        core = self.rt.core
        reply = stats_to_proto(core.stats())
        region = core.kv.shared if core.kv is not None else None
        if region is not None:  # a host sync on GPU: a stats call, not the data path
            reply.shared_rows = region.live(core.layout.page_size)
        return reply

    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        if not 0 <= request.timeout_seconds <= 3600:
            raise InvalidArgument(
                "timeout_seconds must be in [0, 3600]", timeout_seconds=request.timeout_seconds
            )
        core = self.rt.core
        core.start_drain()
        await self._on_drain()
        drained = await self.wait_idle(request.timeout_seconds)
        return pb.DrainResponse(drained=drained, remaining_requests=core.num_requests)

    async def Flush(
        self, request: pb.FlushRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushResponse:
        freed, in_use = self.rt.core.flush()
        return pb.FlushResponse(pages_freed=freed, pages_in_use=in_use)

    async def TransferTarget(
        self, request: pb.TransferTargetRequest, context: grpc.aio.ServicerContext
    ) -> pb.TransferTargetResponse:
        target = self.rt.transfer
        if target is None:
            raise TransferUnsupported("this service was started without --nixl: no transfers")
        return target_to_proto(target)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is left, at most `timeout` seconds; True if none is left."""
        try:
            async with asyncio.timeout(timeout):
                while self.rt.core.num_requests:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            return False
        return True
