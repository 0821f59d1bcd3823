"""Stopping a foreground command the same way whatever stopped it: SIGTERM, SIGHUP and SIGINT
(`kill`, `timeout`, a closed terminal, Ctrl-C) are recorded, and what the command waits for is
interrupted at a point where its cleanup can still run. The demo uses it to stop its children
and remove their files before it exits with 128 + the signal number."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class StopSignals:
    """Records the first stop signal and interrupts what the demo waits for: the streams (their
    asyncio task is cancelled) or a child's start-up (`requested` is polled). The handler never
    raises, so nothing is cut off half-way (an event loop being built, the cleanup); later
    signals are only ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            if self._task is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    async def run(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """Await `coro`; None if a stop signal came first or cancelled it."""
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            if self.signum is not None:
                coro.close()
                return None
            return await coro
        except asyncio.CancelledError:
            if self.signum is None:
                raise
            return None
        finally:
            self._loop = self._task = None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
