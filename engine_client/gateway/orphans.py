"""Requests the engine would finish for no client, and their cancellation.

A gateway stream cut because the engine stopped (SIGTERM under `--state-file`: its last response
advises to resume; killed: the call fails UNAVAILABLE) leaves its request in the engine's state
file, and the restarted engine resumes it. The gateway's client cannot: it got a 503 or an
error event and the gateway has no resume route. So the gateway cancels the request itself once
the engine serves again: it attaches to it by id (Generate with resume_request_id) and cancels
that call, which cancels the request as for any client that goes away.

It waits for SERVING first: a stopping engine still answers a resume of the request it has just
ended (the replay, then its error), and cancelling that would cancel nothing; the restarted one
is NOT_SERVING until it has restored its requests. It watches the engine's health (one Watch
stream for all requests) rather than polling it: the restarted engine decodes what it restored
from the moment it serves, so the cancel must follow at once.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
REQUEST_ID_KEY = "request-id"  # the engine names a request in this initial metadata entry
RETRY = 0.2  # seconds between attempts when the engine serves but an attempt failed
ATTACH_TIMEOUT = 5.0  # one attempt's deadline
# The engine does not have the request (ended, released, or no state file), or never will.
GIVE_UP = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
SERVING = health_pb2.HealthCheckResponse.SERVING


class Orphans:
    """The requests to cancel (id -> when to give up), and the one task that cancels them."""

    def __init__(self, channel: grpc.aio.Channel, service: str, window: float) -> None:
        """service: the engine's name in its health service; window: seconds to keep trying."""
        self.stub = pb_grpc.DecodeServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.service, self.window = service, window
        self.pending: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._closed = False

    def cancel(self, request_id: str) -> None:
        """Cancel `request_id` in the engine once it serves again (in the background)."""
        if self._closed:  # the gateway stops: a stream that ends now has no one to cancel it
            return
        loop = asyncio.get_running_loop()
        self.pending[request_id] = loop.time() + self.window
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="gateway-orphans")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pending:
            try:
                await self._attempt(loop)
            except Exception:  # no one awaits this task: a raise would end it, silently
                log.exception("cancelling requests cut by an engine stop; trying again")
            for request_id, deadline in list(self.pending.items()):
                if deadline <= loop.time():
                    log.warning("request %s, cut by an engine stop: not cancelled", request_id)
                    del self.pending[request_id]
            if self.pending:
                await asyncio.sleep(RETRY)

    async def _attempt(self, loop: asyncio.AbstractEventLoop) -> None:
        """Once the engine serves, attach to every pending request and cancel it."""
        if await self._until_serving(min(self.pending.values()) - loop.time()):
            ids = list(self.pending)
            done = await asyncio.gather(*(self._attach_and_cancel(i) for i in ids))
            for request_id in (i for i, ok in zip(ids, done) if ok):
                del self.pending[request_id]

    async def _until_serving(self, timeout: float) -> bool:
        """True once the engine says SERVING; False if the watch ends first (the engine went
        away, or `timeout` passed). Waits for a connection: the engine may not listen yet."""
        request = health_pb2.HealthCheckRequest(service=self.service)
        call = self.health.Watch(request, timeout=max(timeout, 0.01), wait_for_ready=True)
        try:
            async for resp in call:
                if resp.status == SERVING:
                    return True
        except grpc.RpcError:
            pass
        finally:
            call.cancel()
        return False

    async def _attach_and_cancel(self, request_id: str) -> bool:
        """True once done: the engine had the request and cancels it, or does not have it."""
        call = self.stub.Generate(
            pb.GenerateRequest(resume_request_id=request_id), timeout=ATTACH_TIMEOUT
        )
        try:
            metadata = dict(await call.initial_metadata() or ())
            if metadata.get(REQUEST_ID_KEY) == request_id:  # attached: the engine follows it
                log.info("request %s, cut by an engine stop: cancelled", request_id)
                return True
            code = await call.code()
        except grpc.RpcError as e:  # before any status (the channel is down)
            code = e.code()
        finally:
            call.cancel()
        return code in GIVE_UP


async def request_id(call: grpc.aio.UnaryStreamCall) -> str:
    """The engine's id of the request of `call`, if it sent it."""
    try:
        return dict(await call.initial_metadata() or ()).get(REQUEST_ID_KEY, "")
    except grpc.RpcError:
        return ""
