"""The processes a benchmark starts: their environment, the engine's and the service's
arguments every benchmark passes the same way, free ports and the shared-memory files left.

The engine and service processes themselves come from engine_client.serve.procs; this module
holds what the benchmarks add on top, so e2e, prefix, mtp and gateway write it once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from contract import flags
from engine_client.serve.procs import REPO_ROOT, segment_files
from engine_client.serve.settings.local_layout import LocalLayout

SHM_DIR = "/dev/shm"
# A benchmark's engine waits for a slow service (first CUDA use, a large host tier) and logs
# only warnings: their logs are read when a run fails.
ENGINE_TAIL = ("--rpc-timeout", "60", "--attach-timeout", "120", "--log-level", "WARNING")


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, so a child started
    from anywhere imports this checkout's packages."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_python(code: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -c code args...` in the repository, output captured: a measurement that must not
    leave a CUDA context or GPU memory in the benchmark's own process."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def engine_argv(preset: str, max_batch: int, prefill_chunk: int, run: list[str]) -> list[str]:
    """The engine's arguments: model, batch and prefill chunk, the run's own (`run`), then the
    timeouts and log level every benchmark uses."""
    head = ["--preset", preset, "--max-batch", str(max_batch), "--prefill-chunk"]
    return [*head, str(prefill_chunk), *run, *ENGINE_TAIL]


def local_kv(device: str, layout: LocalLayout) -> list[str]:
    """An engine that holds its KV itself (baseline, embedded): its device and its layout."""
    return ["--device", device, *flags.to_flags(layout)]


def service_extra(*extra: str) -> list[str]:
    """The service's arguments beside its layout: short leases (a benchmark's engines come and
    go), `extra`, and warnings only."""
    return ["--lease-seconds", "10", *extra, "--log-level", "WARNING"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_segments(instance: str) -> list[str]:
    """Unlink the shared-memory files a service instance left; their names (none after a
    clean stop)."""
    left = segment_files(SHM_DIR, instance)
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    return left
