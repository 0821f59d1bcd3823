"""One concept, the process supervisor of the demo, the benchmarks and the multi-process tests: a KV
service or an engine as a child process on a socket in a temporary directory, ready when its
grpc health says SERVING, stopped with SIGTERM (then SIGKILL), and ended by the kernel if the
process that started it dies.

Readiness is watched through grpc.health.v1 Watch with short deadlines, checking between two
watches that the child is still alive, so a child that dies at start-up fails fast with its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract import cuda_shm
from kernels import toolchain

REPO_ROOT = Path(__file__).resolve().parents[2]
KV_SERVICE_NAME = "kvcache.v1.KVCacheService"
ENGINE_SERVICE_NAME = "decode.v1.DecodeService"


# Runs in the child before the real program: asks the kernel to SIGTERM it when its parent dies
# (even by SIGKILL), then execs the program, which keeps that setting. A launcher rather than a
# preexec_fn: a preexec_fn makes subprocess fork() the whole gRPC-using parent, whose fork
# handlers raced with its poller threads (a child aborted with "epoll_wait: Bad file
# descriptor"); without one, subprocess spawns with vfork and runs no fork handlers.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('parent gone before start')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _die_with_parent(args: list[str]) -> list[str]:
    """`args` behind the launcher above, so that a killed demo or test never leaves a service
    or engine behind. (The kernel signals when the starting *thread* ends: start children from
    a thread that lives as long as they.)"""
    if sys.platform != "linux":
        return list(args)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]


# Health watch outcomes that only mean "not yet": no socket, or no change within the window.
_NOT_YET = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class ChildFailed(RuntimeError):
    """A child process exited, or never became healthy."""


class ManagedProcess:
    """One child process with its log file; `stop` ends it (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: str,
        target: str,
        health_service: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name, self.args, self.log_path = name, list(args), log_path
        self.target, self.health_service = target, health_service
        self.env = dict(os.environ if env is None else env)
        # The children import the repository's packages wherever the parent was started.
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), self.env.get("PYTHONPATH", "")) if p
        )
        self.proc: subprocess.Popen | None = None
        self._cleaned: set[int] = set()  # children whose CUDA driver files were removed

    def start(self) -> "ManagedProcess":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                _die_with_parent(self.args),
                cwd=REPO_ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> subprocess.Popen | None:
        """The child while it runs; None before `start` and once it has exited."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        if self.proc is not None and self.proc.pid not in self._cleaned:
            self._cleaned.add(self.proc.pid)  # exited, reaped: the driver files it left go
            cuda_shm.remove_of(self.proc.pid)
        return None

    def alive(self) -> bool:
        return self.running() is not None

    def log(self, tail: int | None = 4000) -> str:
        """The last `tail` characters of the child's output (None: all of it)."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
            return text if tail is None else text[-tail:]
        except FileNotFoundError:
            return ""

    def wait_serving(
        self, timeout: float = 60.0, abort: Callable[[], bool] | None = None
    ) -> "ManagedProcess":
        """Block until health reports SERVING; ChildFailed if the child dies or time runs out."""
        return self.wait_status(health_pb2.HealthCheckResponse.SERVING, timeout, abort)

    def wait_status(
        self, status: int, timeout: float, abort: Callable[[], bool] | None = None
    ) -> "ManagedProcess":
        """Block until health reports `status`; ChildFailed if the child dies, time runs out,
        or `abort()` (asked about once a second) says to stop waiting."""
        deadline = time.monotonic() + timeout
        request = health_pb2.HealthCheckRequest(service=self.health_service)
        # Until the child listens gRPC backs off 1 s, x1.6: one serving at 3 s was seen at 5.2 s.
        fast = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
        with grpc.insecure_channel(self.target, options=fast) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if not self.alive():
                    code = None if self.proc is None else self.proc.returncode
                    raise ChildFailed(f"{self.name} exited with {code}:\n{self.log()}")
                if abort is not None and abort():
                    raise ChildFailed(f"{self.name}: start-up abandoned")
                window = min(1.0, max(0.05, deadline - time.monotonic()))
                if self._watch_once(stub, request, status, window):
                    return self
        raise ChildFailed(
            f"{self.name} not in health status {status} after {timeout:g}s:\n{self.log()}"
        )

    def _watch_once(
        self,
        stub: health_pb2_grpc.HealthStub,
        request: health_pb2.HealthCheckRequest,
        status: int,
        window: float,
    ) -> bool:
        """Whether health reports `status` within `window` (False: not listening yet, or no
        change in time); ChildFailed on any other failure of the watch."""
        try:
            for reply in stub.Watch(request, timeout=window, wait_for_ready=True):
                if reply.status == status:
                    return True
            return False
        except grpc.RpcError as e:
            # The failed call is its own exception and grpc's frames in its traceback refer to
            # it: drop the traceback, or that cycle keeps our caller's frames (and whatever
            # they hold, e.g. mapped memory) alive until the next gc.
            e.__traceback__ = None
            if e.code() in _NOT_YET:
                return False
            raise ChildFailed(f"{self.name} health: {e.code().name}: {e.details()}") from None

    def signal(self, sig: int) -> None:
        if (proc := self.running()) is not None:
            proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """The exit status once the child ends by itself (subprocess.TimeoutExpired if not)."""
        assert self.proc is not None
        self.proc.wait(timeout)
        return self.stop()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit status."""
        if self.proc is None:
            return 0
        if (proc := self.running()) is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        code = self.proc.wait(10)
        self.running()  # reaped: its CUDA driver files go (contract.cuda_shm)
        return code

    def kill(self) -> None:
        if (proc := self.running()) is not None:
            proc.kill()
            proc.wait(10)
            self.running()


def service_command(
    uds: str,
    instance: str,
    layout_flags: Sequence[str],
    *,
    device: str,
    shm_dir: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """`python -m kv_service` on `uds`; flags later in the list (`extra`) win."""
    where = ["--uds", uds, "--device", device, "--instance", instance, "--shm-dir", shm_dir]
    return [sys.executable, "-m", "kv_service", *where, *layout_flags, *extra]


def service_env(token: str | None = None) -> dict[str, str]:
    """The service child's environment: ours without KVS_* (the command line says it all),
    plus its token, which stays out of `ps`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVS_")}
    # Its CPU work is bookkeeping: OpenMP threads would only spin against the engine's.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(toolchain.child_env())  # the CUDA tools our Triton found, whatever wraps the child
    if token:
        env["KVS_TOKEN"] = token
    return env


def service_process(
    workdir: str,
    instance: str,
    layout_flags: Sequence[str],
    *,
    device: str = "cpu",
    shm_dir: str = "/dev/shm",
    extra: Sequence[str] = (),
    token: str | None = None,
) -> ManagedProcess:
    """`layout_flags`: contract.flags.to_flags(layout)."""
    uds = os.path.join(workdir, "kv.sock")
    args = service_command(uds, instance, layout_flags, device=device, shm_dir=shm_dir, extra=extra)
    return ManagedProcess(
        "kv_service",
        args,
        os.path.join(workdir, "kv_service.log"),
        f"unix:{uds}",
        KV_SERVICE_NAME,
        env=service_env(token),
    )


def engine_process(
    workdir: str,
    kv_mode: str,
    *,
    service_uds: str = "",
    name: str = "engine",
    extra: Sequence[str] = (),
) -> ManagedProcess:
    uds = os.path.join(workdir, f"{name}.sock")
    args = [
        sys.executable,
        "-m",
        "engine_client",
        "serve",
        "--kv-mode",
        kv_mode,
        "--uds",
        uds,
        "--engine-name",
        name,
        *(["--service", service_uds] if service_uds else []),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
    env.update(toolchain.child_env())
    return ManagedProcess(
        name,
        args,
        os.path.join(workdir, f"{name}.log"),
        f"unix:{uds}",
        ENGINE_SERVICE_NAME,
        env=env,
    )


def segment_files(shm_dir: str, instance: str) -> list[str]:
    """Shared-memory files of a service instance (kv_service.memory.shm_file names them
    hisparse-<instance>-<pid>-<tensor>)."""
    prefix = f"hisparse-{instance}-"
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(prefix))
    except FileNotFoundError:
        return []
