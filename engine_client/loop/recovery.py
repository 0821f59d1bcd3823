"""Recovery of an engine whose KV service was lost, from the loss to serving again.

Once the engine has failed every request (`Failures.fail_all`), `ServiceRecovery.start` runs one
task that
1. waits until no launched step runs on the device (`device_quiet`, which the engine sets while
   no step is in flight): only then may the lost service's memory be unmapped;
2. lets go of it through the control (`KVControl.let_go`: the compute drops its graphs and
   views, the client unmaps every segment and checks that its CUDA IPC mappings closed) and sets
   `failed`, which turns the server's health NOT_SERVING;
3. waits for the control to re-attach to a restarted service at the same address
   (`KVControl.reattach`, which points the compute at the new memory);
4. calls the `then` that `start` was given (the engine serves again) and sets `recovered`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engine_client.client import errors
from engine_client.client.control import MemoryUser
from engine_client.loop.control_ref import ControlRef

log = logging.getLogger(__name__)


class ServiceRecovery:
    """One recovery at a time; `failed` / `recovered` are what the server watches."""

    def __init__(
        self,
        control: ControlRef,
        user: MemoryUser,
        *,
        device_quiet: asyncio.Event,
    ) -> None:
        self.control, self.user, self._device_quiet = control, user, device_quiet
        # Set once the service is lost and its memory let go of (NOT_SERVING); `recovered` once
        # the control re-attached to a restarted service and new requests are served again.
        self.failed = asyncio.Event()
        self.recovered = asyncio.Event()
        self.rounds = 0  # completed recoveries, for the logs
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self, then: Callable[[], None]) -> None:
        """Begin recovering, unless a recovery already runs; `then` runs once re-attached."""
        if self._task is None:
            self.recovered.clear()
            task = self._run(then)
            self._task = asyncio.get_running_loop().create_task(task, name="kv-recovery")

    def give_up(self) -> None:
        """A failure that no re-attach mends (the engine loop broke): NOT_SERVING for good."""
        self.failed.set()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self, then: Callable[[], None]) -> None:
        try:
            await self._device_quiet.wait()
            self.control.current.let_go(self.user)
            self.failed.set()
            log.info("lost KV service let go of; waiting for it to come back")
            await self.control.current.reattach(self.user)
        except errors.KVError as e:
            log.error("KV service not re-attached: %s", e)
            return
        finally:
            self._task = None
        self.rounds += 1
        then()
        self.failed.clear()
        self.recovered.set()
        log.info("KV service re-attached (recovery %d): serving new requests", self.rounds)
