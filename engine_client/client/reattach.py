"""What a `KVClient` does when its service is lost: the same-session re-attach after a stream
drop, dying when that cannot work, letting go of the lost service's memory, and attaching to the
successor at the same address.

`Reattachment` is the client's collaborator for this (the client holds one, as the engine holds
its `ServiceRecovery`); the memory it lets go of is the client's `Mapping`.

- After a stream break the client re-attaches once with its session id. A service that is gone,
  or that restarted (new epoch, or it no longer knows the session), makes the client dead:
  `check_alive` raises, so the engine launches nothing more on the mapped memory and discards
  the step that was running.
- Between steps the engine then calls `let_go`: the memory user (the engine's compute) drops
  its graphs and views, the client unmaps every segment (a deleted /dev/shm file stays
  allocated while mapped) and checks that every CUDA IPC mapping is closed, naming the tensor
  and its holders when one is not (`contract.ipc_release`).
- `reattach` waits for a service at the same address (a new epoch), attaches as a new session,
  maps its memory and points the memory user at it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from contract import errors
from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.client.control import MemoryUser
from engine_client.client.mapping import Mapping
from proto.kvcache.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# Between two failed re-attach attempts (doubling): a service that answers but refuses us.
REATTACH_BACKOFF = (0.1, 5.0)


class Client(Protocol):
    """What the recovery uses of its KVClient: the attach steps and the session's state."""

    target: str
    epoch: int
    session_id: str
    layout: KVLayout | None
    attach_timeout: float
    closing: bool
    memory: Mapping
    tensors: KVTensors | None
    exchange: dict

    @property
    def stream_open(self) -> bool: ...

    async def attach(
        self, resume: str, expected: KVLayout | None, wait: bool
    ) -> pb.AttachResponse: ...

    def map(self, reply: pb.AttachResponse) -> None: ...

    async def open_stream(self) -> None: ...

    def stop_using(self, why: errors.KVError) -> None: ...


class Reattachment:
    """Whether `client`'s service and memory can still be trusted, and the way back when not:
    the same-session retry after a stream drop, then let_go and reattach to a successor."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.dead: errors.KVError | None = None  # why the client is dead, until reattach
        self._task: asyncio.Task | None = None  # the same-session re-attach under way
        self._recovering = False  # a stream that breaks now kills the client (no retry)

    # --- a broken stream ---

    def stream_lost(self, why: errors.KVError) -> None:
        c = self.client
        if c.closing or self.dead is not None:
            return
        log.warning("session stream to %s lost: %s", c.target, why)
        if self._recovering or not c.memory.owner_alive():
            self.die(errors.ServiceUnavailable(f"KV service at {c.target} is gone: {why}"))
            return
        self._task = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        """Re-attach once with the same session; anything but the same epoch means stale
        memory, and a new stream that breaks at once means the service is not usable."""
        c = self.client
        old_epoch = c.epoch
        self._recovering = True
        try:
            await c.attach(c.session_id, c.layout, wait=False)
            if c.epoch != old_epoch:
                raise errors.EpochMismatch(f"service restarted (epoch {old_epoch} -> {c.epoch})")
            await c.open_stream()
            log.info("session %s re-attached after a stream drop", c.session_id)
        except errors.KVError as e:
            self.die(errors.ServiceUnavailable(f"KV service at {c.target} lost: {e}"))
        finally:
            self._recovering = False

    async def wait_recovered(self) -> None:
        """Return once a stream drop's re-attach is over; raise if the client is dead."""
        if self.dead is not None:
            raise self.dead
        c, task = self.client, self._task
        # A broken stream's loss callback runs in the same loop turn, so a recovery task exists.
        if not c.stream_open and task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), c.attach_timeout)
            except TimeoutError:
                took = f"re-attach took over {c.attach_timeout:g}s"
                self.die(errors.ServiceUnavailable(f"KV service at {c.target}: {took}"))
        if self.dead is not None:
            raise self.dead

    def die(self, why: errors.KVError) -> None:
        """Dead until `reattach`. The memory is only unmapped in let_go() or close(): a step may
        still be running on it in the compute thread; the engine discards that step
        (check_alive) and launches no other."""
        if self.dead is not None:
            return
        log.error("%s; failing every request, no longer using the mapped memory", why)
        self.dead = why
        self.client.stop_using(why)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        if not self.client.memory.owner_alive():
            gone = errors.ServiceUnavailable(f"KV service at {self.client.target} is gone")
            self.die(gone)
            raise gone

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # --- after the service is lost: let go of it, attach to its successor ---

    def let_go(self, user: MemoryUser | None = None) -> None:
        """Unmap every segment of the service now: `user` drops its references first, then the
        client. Only while no step runs on the memory (the engine calls it between steps).
        Idempotent."""
        self.cancel()  # a same-session re-attach would find nothing mapped
        self.die(errors.ServiceUnavailable(f"KV service at {self.client.target} let go of"))
        if user is not None:
            user.bind_kv(None, {})
        ipc = self.client.memory.unmap()
        if ipc:
            self.client.memory.check_ipc_closed(ipc)

    async def reattach(self, user: MemoryUser | None = None) -> None:
        """After the service was lost and let go of: wait for a service at the same address,
        attach to it as a new session, map its memory and point `user` at it. Retries with
        backoff until it succeeds (a service that is down is waited for on the channel);
        cancel the call, or close the client, to give up."""
        c = self.client
        if self.dead is None or c.memory.mapped:
            raise RuntimeError("reattach() needs a lost service, let go of first")
        delay = REATTACH_BACKOFF[0]
        while True:
            if c.closing:
                raise errors.ServiceUnavailable(f"KV client of {c.target} closed")
            try:
                await self._attach_again()
                break
            except errors.KVError as e:
                log.warning("re-attach to %s failed: %s; next try in %.1fs", c.target, e, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, REATTACH_BACKOFF[1])
        if user is not None:
            user.bind_kv(c.tensors, c.exchange)

    async def _attach_again(self) -> None:
        c = self.client
        old_epoch = c.epoch
        reply = await c.attach("", c.layout, wait=True)
        # A stream that breaks while it opens kills the client again (no same-session retry).
        self._recovering = True
        try:
            c.map(reply)
            self.dead = None
            await c.open_stream()
        except BaseException as e:
            self.dead = self.dead or errors.ServiceUnavailable(f"re-attach failed: {e}")
            c.stop_using(self.dead)
            c.memory.unmap()
            raise
        finally:
            self._recovering = False
        c.memory.remove_stale_counters()
        log.info(
            "re-attached to %s as session %s: epoch %d -> %d",
            c.target,
            c.session_id,
            old_epoch,
            c.epoch,
        )
