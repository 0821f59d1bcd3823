"""The Session bidi stream of kvcache.v1: numbered requests, one reader task, heartbeats.

Every message gets the next seq; the service answers each one, in order, with the same seq. One
reader task resolves the waiting futures by seq. A reply that does not come within the deadline,
a read error or the end of the stream all mean the stream is lost: every pending request fails
at once with the same error and `on_lost` is told (once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from contract import errors
from engine_client.client.status import rpc_errors
from proto.kvcache.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)


class NotSent(errors.ServiceUnavailable):
    """The stream was already broken when the message was written: the service never saw it,
    so the caller may send it again on a new stream."""


class SessionStream:
    def __init__(
        self,
        call: grpc.aio.StreamStreamCall,
        timeout: float,
        heartbeat_interval: float,
        heartbeat: Callable[[], Awaitable[object]],
        on_lost: Callable[[errors.KVError], None],
    ) -> None:
        self._call = call
        self._timeout = timeout
        self._interval = heartbeat_interval
        self._heartbeat = heartbeat
        self._on_lost = on_lost
        self._pending: dict[int, asyncio.Future] = {}
        self._write_lock = asyncio.Lock()
        self._seq = 0
        self._lost: errors.KVError | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def open(self) -> bool:
        return self._lost is None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_loop(), name="kv-session-reader"),
            loop.create_task(self._heartbeat_loop(), name="kv-heartbeat"),
        ]

    async def request(self, msg: pb.SessionMessage, what: str) -> pb.SessionReply:
        """Send one message and wait for its reply (in-band errors are the caller's)."""
        if self._lost is not None:
            raise NotSent(str(self._lost))
        self._seq += 1
        msg.seq = seq = self._seq
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            async with asyncio.timeout(self._timeout):
                async with self._write_lock:
                    await self._write(msg, what)
                return await fut
        except TimeoutError:
            err = errors.DeadlineExceeded(
                f"{what}: no reply from the KV service within {self._timeout:g}s"
            )
            self.stop(err)
            raise err from None
        finally:
            self._pending.pop(seq, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # marks a failure set by stop() as seen

    async def _write(self, msg: pb.SessionMessage, what: str) -> None:
        try:
            with rpc_errors(what):
                await self._call.write(msg)
        except errors.KVError as e:
            self.stop(errors.ServiceUnavailable(str(e)))
            raise NotSent(str(self._lost)) from e
        except asyncio.InvalidStateError as e:
            self.stop(errors.ServiceUnavailable(f"{what}: session stream is closed"))
            raise NotSent(str(self._lost)) from e

    async def _read_loop(self) -> None:
        try:
            while True:
                with rpc_errors("Session"):
                    reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    raise errors.ServiceUnavailable("the KV service ended the session stream")
                fut = self._pending.get(reply.seq)
                if fut is None:
                    log.warning("reply with unknown seq %d dropped", reply.seq)
                elif not fut.done():
                    fut.set_result(reply)
        except errors.KVError as e:
            self.stop(
                e if isinstance(e, errors.ServiceUnavailable) else errors.ServiceUnavailable(str(e))
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # Not our task being cancelled: grpc raises this when the call itself was cancelled.
            self.stop(errors.ServiceUnavailable("the session stream was cancelled"))

    async def _heartbeat_loop(self) -> None:
        while self._lost is None:
            await asyncio.sleep(self._interval)
            try:
                await self._heartbeat()
            except errors.ServiceUnavailable:
                return
            except errors.KVError as e:
                self.stop(errors.ServiceUnavailable(f"heartbeat refused: {e}"))
                return

    def stop(self, why: errors.KVError) -> None:
        """Mark the stream lost: fail every pending request, end the call, tell the owner."""
        if self._lost is not None:
            return
        self._lost = why
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(why)
        self._pending.clear()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._call.cancel()
        self._on_lost(why)

    async def aclose(self) -> None:
        """End the stream from our side (no loss is reported)."""
        if self._lost is None:
            self._on_lost = lambda why: None
            with contextlib.suppress(errors.KVError, asyncio.InvalidStateError, TimeoutError):
                with rpc_errors("Session"):
                    await asyncio.wait_for(self._call.done_writing(), self._timeout)
            self.stop(errors.ServiceUnavailable("session stream closed by the client"))
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
