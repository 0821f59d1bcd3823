"""What a `KVClient` does when its service is lost: the same-session re-attach after a stream
drop, dying when that cannot work, letting go of the lost service's memory, and attaching to the
successor at the same address.

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

from contract import handle, segment_map
from contract.ipc_release import remove_counter_files
from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.client import errors
from engine_client.client.control import MemoryUser
from engine_client.client.session_stream import SessionStream
from proto.kvcache.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# Between two failed re-attach attempts (doubling): a service that answers but refuses us.
REATTACH_BACKOFF = (0.1, 5.0)


class Reattachment:
    """The loss-and-recovery half of KVClient (which provides the attach, map and stream
    methods declared here)."""

    target: str
    epoch: int
    session_id: str
    layout: KVLayout | None
    attach_timeout: float
    tensors: KVTensors | None
    exchange: dict
    _segments: segment_map.SegmentMap
    _owner_files: list[dict]
    _handles: list[dict]
    _mapped: KVTensors | None
    _mapped_exchange: dict
    _stream: SessionStream | None
    _dead: errors.KVError | None
    _recover_task: asyncio.Task | None
    _recovering: bool
    _closing: bool
    _stale_counters: list[tuple[int, str]]

    async def _attach(
        self, resume: str, expected: KVLayout | None, wait: bool
    ) -> pb.AttachResponse:
        raise NotImplementedError  # KVClient's

    def _map(self, reply: pb.AttachResponse) -> None:
        raise NotImplementedError

    async def _open_stream(self) -> None:
        raise NotImplementedError

    # --- a broken stream ---

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
        ipc = [h for h in self._handles if h["kind"] == "cuda_ipc"]
        self._unmap()
        if ipc:
            self._check_ipc_closed(ipc)

    def _unmap(self) -> None:
        if self._mapped is not None:
            self._segments.unmap(self._mapped)
        self._segments.unmap(self._mapped_exchange)
        self._segments.forget_files(self._handles)
        self.tensors, self.exchange, self._mapped, self._mapped_exchange = None, {}, None, {}
        self._owner_files, self._handles = [], []

    def _check_ipc_closed(self, ipc: list[dict]) -> None:
        """Every CUDA IPC storage mapped from the service must be gone now: its mapping closes
        with the last one. Says which is not, and who holds it; removes the reference counter
        files of a dead exporter (a SIGKILLed service leaves them in /dev/shm)."""
        left = self._segments.ipc.unreleased()
        if left:
            log.error(
                "CUDA IPC memory of the service at %s is still mapped after letting go: %s",
                self.target,
                "; ".join(str(x) for x in left),
            )
        else:
            log.info("closed the %d CUDA IPC mappings of the service at %s", len(ipc), self.target)
        shares = [handle.decode_ipc(h["ipc"]) for h in ipc]
        self._stale_counters += [(pid, share[4].decode(errors="replace")) for pid, share in shares]
        self._remove_stale_counters()

    def _remove_stale_counters(self) -> None:
        """Unlink the counter files of lost exporters that are dead by now. One that still runs
        (exiting, or not yet reaped) is tried again at the next re-attach."""
        removed, self._stale_counters = remove_counter_files(self._stale_counters)
        if removed:
            log.info("removed %d CUDA IPC counter files of the dead service", removed)

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
        self._remove_stale_counters()
        log.info(
            "re-attached to %s as session %s: epoch %d -> %d",
            self.target,
            self.session_id,
            old_epoch,
            self.epoch,
        )
