"""The processes of bench.e2e's runs: the kv service (kept while consecutive runs share its
layout), the current engine, and the one progress line on stderr."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from bench.e2e import plan, run_args
from bench.shared.child import SHM_DIR, free_port, remove_segments, service_extra
from engine_client.serve.procs import (
    ChildFailed,
    ManagedProcess,
    engine_process,
    segment_files,
    service_process,
)

# Starts of a child whose metrics port another process took first (see Children._serving).
PORT_ATTEMPTS = 3


class Progress:
    """One live line on stderr (a line every few seconds when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.t0, self.tty = total, time.monotonic(), sys.stderr.isatty()
        self._last = 0.0

    def line(self, i: int, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and not self.tty and now - self._last < 5:
            return
        self._last = now
        msg = f"[{i}/{self.total} {now - self.t0:5.0f}s] {text}"
        if self.tty:  # redraw in place; a forced line stays
            print("\r" + msg.ljust(110), file=sys.stderr, end="\n" if force else "", flush=True)
        else:
            print(msg, file=sys.stderr, flush=True)


class Children:
    """The kv service (kept while consecutive runs share its layout) and the current engine."""

    def __init__(self, sizes: plan.Sizes, workdir: str, instance: str, timeout: float) -> None:
        self.sizes, self.workdir, self.instance, self.timeout = sizes, workdir, instance, timeout
        self.service: ManagedProcess | None = None
        self.service_key: tuple | None = None
        self.metrics_port: int | None = None
        self.engine: ManagedProcess | None = None
        self.engine_metrics_port: int | None = None

    def service_for(self, run: plan.Run) -> ManagedProcess | None:
        key = (run.context, run.slots, run.hot_slots, run.max_context, run.draft_tokens)
        if run.mode not in ("service", "service-remote-swap"):
            self.stop_service()  # its host tier and GPU memory are not the next run's
            return None
        if self.service_key != key:
            self.stop_service()
            self.service, self.metrics_port = self._serving(
                lambda port: service_process(
                    self.workdir,
                    self.instance,
                    run_args.service_flags(self.sizes, run),
                    device=self.sizes.device,
                    shm_dir=SHM_DIR,
                    extra=service_extra("--drain-timeout", "5", "--metrics-port", str(port)),
                )
            )
            self.service_key = key
        return self.service

    def start_engine(self, run: plan.Run, name: str) -> ManagedProcess:
        uds = self.service.target.removeprefix("unix:") if run.mode.startswith("service") else ""
        # The engine's /metrics: step GPU time and GPU idle, next to the clients' ITL.
        self.engine, self.engine_metrics_port = self._serving(
            lambda port: engine_process(
                self.workdir,
                run.mode,
                service_uds=uds,
                name=name,
                extra=run_args.engine_flags(self.sizes, run) + ["--metrics-port", str(port)],
            )
        )
        return self.engine

    def _serving(self, make: Callable[[int], ManagedProcess]) -> tuple[ManagedProcess, int]:
        """A child made by make(metrics port), serving, and its port. free_port() names a port
        that was free a moment ago; another process (a parallel test, another benchmark) may
        bind it before the child does, so a child that lost that race starts again on another."""
        for attempt in range(PORT_ATTEMPTS):
            port = free_port()
            child = make(port)
            try:
                return child.start().wait_serving(self.timeout), port
            except ChildFailed:
                child.stop()
                if attempt + 1 == PORT_ATTEMPTS or "Address already in use" not in child.log():
                    raise
        raise AssertionError("unreachable")

    def stop_engine(self) -> int:
        code = 0
        if self.engine is not None:
            code = self.engine.stop()
            if code != 0:
                print(
                    f"\n{self.engine.name} exited with {code}:\n{self.engine.log()}",
                    file=sys.stderr,
                )
            self.engine = None
        return code

    def shm_bytes(self) -> int:
        return sum(
            os.path.getsize(os.path.join(SHM_DIR, n)) for n in segment_files(SHM_DIR, self.instance)
        )

    def stop_service(self) -> None:
        if self.service is not None:
            self.service.stop()
        self.service = self.service_key = self.metrics_port = None

    def close(self) -> list[str]:
        self.stop_engine()
        self.stop_service()
        return remove_segments(self.instance)
