"""Stale segment removal across PID namespaces: an owner is alive while it holds its lock file,
whatever its pid looks like from here; removal is scoped to one instance name.

A second PID namespace is simulated: a child process creates its segments, and their names are
then moved to a pid that does not exist here, as another container's pid would look."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from contract import handle
from contract.layout import KVLayout
from kv_service.memory import segment, shm_file, shm_room

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(
    num_layers=1,
    max_requests=2,
    hot_slots=16,
    window=4,
    topk=8,
    page_size=4,
    num_pages=4,
    max_context=16,
)
OWNER = """
import json, os, sys, time
from kv_service.memory import segment
from contract.layout import KVLayout
shm_dir, instance, fake_pid = sys.argv[2], sys.argv[3], sys.argv[4]
segment.create_segments(KVLayout(**json.loads(sys.argv[1])), "cpu", shm_dir, instance)
if fake_pid:  # how our files look from another PID namespace; the lock fd stays held
    for name in os.listdir(shm_dir):
        if f"-{instance}-{os.getpid()}" in name:
            os.rename(os.path.join(shm_dir, name), os.path.join(
                shm_dir, name.replace(f"-{os.getpid()}", f"-{fake_pid}", 1)))
print(json.dumps(sorted(os.listdir(shm_dir))), flush=True)
time.sleep(300)
"""


def unused_pid() -> int:
    pid = 4_000_000
    while handle.pid_alive(pid):
        pid += 1
    return pid


class Owner:
    """A service-like owner of segments in a child process."""

    def __init__(self, shm_dir: Path, instance: str, fake_pid: int | None = None) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                OWNER,
                json.dumps(LAYOUT.to_dict()),
                str(shm_dir),
                instance,
                str(fake_pid or ""),
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line, "owner failed to create its segments"
        pid = fake_pid or self.proc.pid
        self.files = sorted(n for n in json.loads(line) if f"-{instance}-{pid}" in n)
        assert any(n.endswith(".lock") for n in self.files) and len(self.files) > 1

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc.stdout.close()


@pytest.fixture
def owners():
    started: list[Owner] = []
    yield started
    for owner in started:
        if owner.proc.poll() is None:
            owner.kill()


def test_live_owner_with_invisible_pid_is_never_removed(tmp_path: Path, owners) -> None:
    ghost = unused_pid()
    first = Owner(tmp_path, "kv", fake_pid=ghost)
    owners.append(first)
    assert not handle.pid_alive(ghost)  # what made the old check call these files stale
    assert segment.remove_stale_segments(str(tmp_path), "kv") == []
    _, _ = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "other")
    try:
        assert segment.remove_stale_segments(str(tmp_path), "other") == []
        assert set(first.files) <= set(os.listdir(tmp_path))
        # Once it is really dead its lock can be taken: its files go, and only its files.
        first.kill()
        removed = segment.remove_stale_segments(str(tmp_path), "kv")
        assert sorted(os.path.basename(p) for p in removed) == sorted(
            n for n in first.files if not n.endswith(".lock")
        )
        left = os.listdir(tmp_path)
        assert not set(first.files) & set(left) and all("-other-" in n for n in left)
    finally:
        segment.remove_segments(str(tmp_path), "other")
    assert os.listdir(tmp_path) == []


def test_dead_owner_of_another_instance_is_left_alone(tmp_path: Path, owners) -> None:
    dead = Owner(tmp_path, "theirs")
    dead.kill()
    assert segment.remove_stale_segments(str(tmp_path), "mine") == []
    assert sorted(os.listdir(tmp_path)) == dead.files
    assert len(segment.remove_stale_segments(str(tmp_path), "theirs")) == len(dead.files) - 1
    assert os.listdir(tmp_path) == []


def test_same_instance_and_pid_in_another_namespace_refuses_to_start(
    tmp_path: Path, owners
) -> None:
    # Another container's service with our instance name whose pid equals ours.
    twin = Owner(tmp_path, "kv", fake_pid=os.getpid())
    owners.append(twin)
    assert segment.remove_stale_segments(str(tmp_path), "kv") == []
    with pytest.raises(RuntimeError, match="another PID namespace"):
        segment.create_segments(LAYOUT, "cpu", str(tmp_path), "kv")
    assert sorted(os.listdir(tmp_path)) == twin.files
    # Our own files are removed by path, never by a pid found in a name.
    segment.remove_segments(str(tmp_path), "kv")
    assert sorted(os.listdir(tmp_path)) == twin.files


def test_files_without_lock_file_are_left_alone(tmp_path: Path) -> None:
    legacy = tmp_path / f"hisparse-kv-{unused_pid()}-host_kv"
    legacy.write_bytes(b"x")
    assert segment.remove_stale_segments(str(tmp_path), "kv") == []
    assert legacy.exists()


def test_no_room_message_names_what_it_found(tmp_path: Path, owners) -> None:
    dead = Owner(tmp_path, "old")
    dead.kill()
    live = Owner(tmp_path, "busy", fake_pid=unused_pid())
    owners.append(live)
    frsize = 4096
    st = os.statvfs_result((frsize, frsize, 1000, 10, 10, 0, 0, 0, 0, 255))
    msg = shm_room.no_room_message(
        str(tmp_path), {"host_kv": 123456, "xchg_topk": 64}, st, lambda n: f"--x-{n}"
    )
    assert (
        "they need 123.5 kB (host_kv 123.5 kB (--x-host_kv), xchg_topk 64 B (--x-xchg_topk))" in msg
    )
    assert f"41.0 kB of {shm_room.human(1000 * frsize)} is free" in msg
    dead_bytes = sum(os.path.getsize(tmp_path / n) for n in dead.files)
    assert (
        f"instance old pid {dead.proc.pid} holds {shm_room.human(dead_bytes)} (owner dead)" in msg
    )
    assert "instance busy pid" in msg and "(owner alive)" in msg
    hidden = (
        1000 * frsize
        - 10 * frsize
        - dead_bytes
        - sum(os.path.getsize(tmp_path / n) for n in live.files)
    )
    assert f"; {shm_room.human(hidden)} is used by files that are not hisparse's" in msg
    assert "\n" not in msg


def test_segments_larger_than_free_space_are_refused_with_the_numbers(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    row_pages = LAYOUT.num_layers * LAYOUT.page_size * LAYOUT.row_bytes
    huge = KVLayout(**{**LAYOUT.to_dict(), "num_pages": free // row_pages + 1})
    with pytest.raises(shm_room.NoRoom) as err:
        segment.create_segments(huge, "cpu", str(tmp_path), "big")
    host = f"host_kv {shm_room.human(huge.host_tier_bytes)} (--num-pages {huge.num_pages}, "
    assert "no room for the KV segments" in str(err.value) and host in str(err.value)
    assert os.listdir(tmp_path) == []


def test_unheld_lock_with_our_pid_is_a_dead_owner_and_replaced(tmp_path: Path) -> None:
    # A dead process that had our pid (pid reuse) left its lock file.
    left = Path(shm_file.lock_path(str(tmp_path), "kv", os.getpid()))
    left.write_bytes(b"")
    segment.create_segments(LAYOUT, "cpu", str(tmp_path), "kv")
    try:
        assert left.exists() and left.stat().st_size == 0
        assert shm_file.take_if_dead(str(left)) is None  # now held, by us
    finally:
        segment.remove_segments(str(tmp_path), "kv")
    assert os.listdir(tmp_path) == []


def test_no_room_message_names_processes_mapping_deleted_segments(tmp_path: Path) -> None:
    kv, _ = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "gone")
    segment.remove_segments(str(tmp_path), "gone")  # names gone, kv still maps the files
    held = shm_room.deleted_mappings(str(tmp_path))
    assert held[os.getpid()] >= LAYOUT.host_tier_bytes
    st = os.statvfs(tmp_path)
    assert f"pid {os.getpid()} still maps {shm_room.human(held[os.getpid()])}" in (
        shm_room.no_room_message(str(tmp_path), {"host_kv": 1}, st)
    )
    del kv


def test_a_killed_process_not_yet_reaped_is_not_alive() -> None:
    """Peers see a SIGKILLed service's sockets close before its parent reaps it: a zombie counts
    as dead, or its CUDA IPC counter files would never be removed."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert handle.pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        with open(f"/proc/{child.pid}/stat") as f:  # wait until it is a zombie, unreaped
            while f.read().rsplit(")", 1)[1].split()[0] != "Z":
                f.seek(0)
        assert not handle.pid_alive(child.pid)
    finally:
        child.kill()
        child.wait(10)
