"""The one process supervisor (engine_client.serve.procs) that the demo, the benchmarks and the
multi-process tests share: a dead child is reported at once with its log, and `stop` ends a
child that ignores SIGTERM with SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from engine_client.serve.procs import KV_SERVICE_NAME, ChildFailed, ManagedProcess, service_env
from tests.service_harness import short_tmpdir


@pytest.fixture
def workdir() -> Iterator[str]:
    path = short_tmpdir("hsp")  # short: a UDS path
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _child(workdir: str, code: str) -> ManagedProcess:
    return ManagedProcess(
        "child",
        [sys.executable, "-c", code],
        os.path.join(workdir, "c.log"),
        f"unix:{workdir}/never.sock",
        KV_SERVICE_NAME,
    )


def test_a_child_that_dies_at_start_up_is_reported_with_its_log(workdir: str) -> None:
    child = _child(workdir, "print('no memory for the host tier'); raise SystemExit(3)")
    child.start()
    with pytest.raises(ChildFailed) as err:
        child.wait_serving(timeout=600)  # the death ends the wait, not the deadline
    assert "exited with 3" in str(err.value) and "no memory for the host tier" in str(err.value)
    assert child.stop() == 3


def test_stop_kills_a_child_that_ignores_sigterm(workdir: str) -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # an ignored signal stays ignored across exec: the child never sees SIGTERM
        child = _child(workdir, "import threading; threading.Event().wait()").start()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert child.alive()
    assert child.stop(timeout=0.5) == -signal.SIGKILL
    assert not child.alive()


def test_service_children_get_no_inherited_kvs_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVS_TOKEN", "parent-token")
    monkeypatch.setenv("KVS_NUM_PAGES", "1")
    env = service_env()
    assert not any(k.startswith("KVS_") for k in env)
    assert service_env("child-token")["KVS_TOKEN"] == "child-token"


def test_a_killed_childs_cuda_driver_files_are_removed_once_it_is_reaped(workdir: str) -> None:
    """The driver's /dev/shm file of a process (contract.cuda_shm) stays when it is SIGKILLed:
    the supervisor removes it after reaping; another process's file stays."""
    code = (
        "import os, threading\n"
        "open(f'/dev/shm/cuda.shm.0.{os.getpid():x}.1', 'w').close()\n"
        "print('made', flush=True)\n"
        "threading.Event().wait()\n"
    )
    other = f"/dev/shm/cuda.shm.0.{os.getpid():x}.9"  # ours: alive, not the child's
    open(other, "w").close()
    try:
        child = _child(workdir, code).start()
        for _ in range(200):
            if "made" in child.log():
                break
            time.sleep(0.05)
        mine = f"/dev/shm/cuda.shm.0.{child.pid:x}.1"
        assert os.path.exists(mine), child.log()
        child.kill()
        assert not os.path.exists(mine) and os.path.exists(other)
    finally:
        os.unlink(other)
