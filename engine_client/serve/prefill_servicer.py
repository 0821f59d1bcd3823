"""prefill.v1.PrefillService of a prefill engine (`serve --role prefill`): one prompt computed as
a request of one token, its rows and index keys written over NIXL into the decode side's pages
when the loop releases it (engine_client.kv.row_export), the first token in the reply (and,
with --speculative mtp, the MTP layer's drafts after it; the layer's KV rows are the layout's
last layer and travel with the others).

A call past the engine's batch is refused at once as full (CapacityError): the decode side then
tries another peer rather than queueing here. A call whose caller goes away (the decode engine
killed or its deadline passed: gRPC cancels the handler) cancels the request and drops its
export at once; nothing waits for EXPORT_TIMEOUT."""

from __future__ import annotations

import asyncio
import logging

import grpc

from contract.codec import target_from_proto
from contract.errors import CapacityError, InvalidArgument, ServiceUnavailable
from contract.layout import LayoutError
from engine_client.kv.row_export import RowExport, Written
from engine_client.loop.engine import Engine
from engine_client.loop.request import Finish, GenRequest, SamplingParams
from proto.prefill.v1 import prefill_pb2 as pb
from proto.prefill.v1 import prefill_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Seconds the write may take once the prompt is computed.
EXPORT_TIMEOUT = 120.0


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, limit: int) -> None:
        self.engine: Engine | None = None
        self.export: RowExport | None = None
        self.limit = limit  # prompts at once: the engine's batch
        self.busy = 0  # prompts being prefilled

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        if self.engine is None or self.export is None:
            raise ServiceUnavailable("the prefill engine is starting")
        prompt = tuple(request.prompt)
        if not prompt:
            raise InvalidArgument("the prompt has no token")
        try:
            target = target_from_proto(request.target)
        except LayoutError as e:
            raise InvalidArgument(f"the target's layout: {e}") from e
        if self.busy >= self.limit:
            raise CapacityError(
                f"the prefill engine is full ({self.limit} prompts)", busy=self.busy
            )
        sampling = SamplingParams(temperature=request.temperature, seed=request.seed)
        req = self.engine.api.submit(prompt, 1, sampling)
        tokens = (request.cached_tokens, len(prompt))
        self.busy += 1
        try:
            done = self.export.expect(req.request_id, target, request.pages, tokens)
            written = await self._computed(req, done)
        except BaseException as e:
            log.info("prefill of %s dropped: %r", request.request_id, e)
            self.engine.api.cancel(req)
            self.export.drop(req.request_id, caller_gone=isinstance(e, asyncio.CancelledError))
            raise
        finally:
            self.busy -= 1
        log.info(
            "prefilled %s: %d tokens, %d bytes in %.6f s",
            *(request.request_id, len(prompt), written.nbytes, written.seconds),
        )
        return _reply(req, written)

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        if self.engine is None or self.export is None:
            raise ServiceUnavailable("the prefill engine is starting")
        export, kv = self.export, await self.engine.control.stats()
        regions = export.agent.regions
        return pb.StatusResponse(
            prompts=self.busy,
            exports_pending=export.pending,
            writes=export.writes,
            peers=export.agent.peers,
            regions=[r.name for r in regions],
            memory_type=",".join(sorted({r.memory_type for r in regions})),
            requests=kv.requests,
            pages_used=kv.pages_used,
            cached_pages=kv.cached_pages,
            exports_written=export.totals.written,
            exports_dropped=export.totals.dropped,
            bytes_written=export.totals.nbytes,
            transfer_seconds=export.totals.seconds,
            busy_seconds=export.busy.seconds,
            region_seconds=export.totals.region_seconds,
        )

    async def _computed(self, req: GenRequest, done: asyncio.Future[Written]) -> Written:
        """Wait for the first token, then for the export of the rows."""
        async for _ in req.follow():
            pass
        if req.finish is not Finish.LENGTH or not req.tokens:
            raise ServiceUnavailable(f"the prefill ended without its token: {req.error}")
        async with asyncio.timeout(EXPORT_TIMEOUT):
            return await done


def _reply(req: GenRequest, written: Written) -> pb.PrefillResponse:
    """The first token, what was written, and (a speculative engine) the MTP drafts after it."""
    return pb.PrefillResponse(
        first_token=req.tokens[0],
        prefilled_tokens=req.prompt_len,
        bytes_written=written.nbytes,
        transfer_seconds=written.seconds,
        drafts=req.first_drafts,
    )
