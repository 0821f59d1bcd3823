"""Segment files in a shm directory (normally /dev/shm), named hisparse-<instance>-<pid>-<name>,
and their owner's lock file hisparse-<instance>-<pid>.lock.

The owner holds an exclusive flock on its lock file for as long as it lives; the kernel drops it
when the process dies, however it dies. A lock that can be taken therefore means a dead owner,
in any PID namespace: services in two containers sharing one /dev/shm cannot see each other's
pids, but they see each other's locks. The pid in the names groups files by owner and lets an
engine in the same namespace tell that its service is gone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets

from contract.handle import FILE_RE  # the file names both sides read

log = logging.getLogger(__name__)


# Segment files and lock files: every file an owner leaves.
ANY_RE = re.compile(
    r"hisparse-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>[0-9]+)(-[A-Za-z0-9_]+|\.lock)"
)
LOCK_RE = re.compile(r"hisparse-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>[0-9]+)\.lock")


def lock_path(shm_dir: str, instance: str, pid: int) -> str:
    return os.path.join(shm_dir, f"hisparse-{instance}-{pid}.lock")


class OwnerLock:
    """This process's lock file for `instance` in `shm_dir`, held until `release`."""

    def __init__(self, shm_dir: str, instance: str) -> None:
        self.path = lock_path(shm_dir, instance, os.getpid())
        # Locked under a private name, then linked into place: nobody can find the final name
        # unlocked and take it for a dead owner's.
        tmp = f"{self.path}.{secrets.token_hex(4)}.tmp"
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._link(tmp)
        except BaseException:
            os.close(self.fd)
            raise
        finally:
            unlink_quietly(tmp)

    def _link(self, tmp: str) -> None:
        try:
            os.link(tmp, self.path)
            return
        except FileExistsError:
            pass
        held = take_if_dead(self.path)
        if held is None:
            raise RuntimeError(
                f"{self.path} is locked by a live process with our pid: another "
                "service of this instance runs in another PID namespace (a "
                "container) on this shm dir; give each one its own --instance"
            )
        unlink_quietly(self.path)
        os.close(held)
        os.link(tmp, self.path)

    def release(self) -> None:
        if self.fd >= 0:
            unlink_quietly(self.path)
            os.close(self.fd)
            self.fd = -1


def take_if_dead(path: str) -> int | None:
    """An fd holding the lock at `path` if its owner is dead (the caller removes the owner's files,
    then the lock file, then closes the fd); None if a live process holds it. FileNotFoundError
    when there is no lock file."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def path_for(shm_dir: str, instance: str, name: str) -> str:
    """The file this process creates for tensor `name` of `instance`."""
    return os.path.join(shm_dir, f"hisparse-{instance}-{os.getpid()}-{name}")


def scan(shm_dir: str, pattern: re.Pattern = FILE_RE) -> list[tuple[os.DirEntry, re.Match]]:
    """Our segment files (or lock files) in shm_dir; a directory that does not exist holds none."""
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return []
    return [(e, m) for e in entries if (m := pattern.fullmatch(e.name))]


# Filesystems whose pages CUDA may pin for good (cudaHostRegister of a shared file mapping).
PINNABLE_FS = ("tmpfs", "hugetlbfs", "shm")


def fs_type(path: str) -> str:
    """The filesystem type of `path` from /proc/self/mountinfo ("" when it cannot be told)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split(" - ")
        if len(fields) != 2:
            continue
        mount_point = fields[0].split()[4].replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, fields[1].split()[0]
    return kind


def remove_stale(shm_dir: str, instance: str, skip_pid: int | None) -> list[str]:
    """Remove the segment and lock files of every dead owner of `instance`; return the segment
    paths removed. The caller's own group (skip_pid) is never looked at."""
    groups: dict[int, list[str]] = {}
    for entry, m in scan(shm_dir):
        if m["instance"] == instance:
            groups.setdefault(int(m["pid"]), []).append(entry.path)
    for _, m in scan(shm_dir, LOCK_RE):
        if m["instance"] == instance:
            groups.setdefault(int(m["pid"]), [])
    removed = []
    for pid, paths in sorted(groups.items()):
        if pid != skip_pid:
            removed += _remove_if_dead(lock_path(shm_dir, instance, pid), pid, paths)
    return removed


def _remove_if_dead(lock: str, pid: int, paths: list[str]) -> list[str]:
    try:
        held = take_if_dead(lock)
    except FileNotFoundError:
        log.warning("segments of pid %d have no lock file; left alone: %s", pid, paths)
        return []
    if held is None:
        log.info("segments of pid %d belong to a live owner; left alone", pid)
        return []
    try:
        removed = [p for p in sorted(paths) if unlink_quietly(p)]
        for path in removed:
            log.warning("removed stale segment %s: its owner (pid %d) is gone", path, pid)
        unlink_quietly(lock)
    finally:
        os.close(held)
    return removed


def unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except PermissionError as e:
        log.warning("cannot remove %s: %s", path, e)
        return False
