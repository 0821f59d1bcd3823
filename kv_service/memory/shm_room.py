"""Room in the shm directory: a segment is refused before it is created when the directory
cannot hold it (`check_room`, `NoRoom` with a message that says who holds the space), and its
pages are reserved at creation (`reserve`) so that a full tmpfs fails there, not as a SIGBUS on
first touch.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

from kv_service.memory.shm_file import ANY_RE, lock_path, scan, take_if_dead

log = logging.getLogger(__name__)


class NoRoom(OSError):
    """The segments do not fit the shm filesystem: a start-up error whose message says it all
    (no traceback needed)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(errno.ENOSPC, message, path)


def human(nbytes: int) -> str:
    """Bytes in decimal units, as df -H and docker's shm_size count them."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def check_room(
    shm_dir: str,
    wanted: dict[str, int],
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    sizing: Callable[[str], str] = lambda name: "",
) -> None:
    """Raise NoRoom, saying what is there, unless `wanted` ({segment name: bytes}) fits.
    `sizing(name)` names the flags that size a segment."""
    st = statvfs(shm_dir)
    if sum(wanted.values()) > st.f_bavail * st.f_frsize:
        raise NoRoom(no_room_message(shm_dir, wanted, st, sizing), shm_dir)


def no_room_message(
    shm_dir: str,
    wanted: dict[str, int],
    st: os.statvfs_result,
    sizing: Callable[[str], str] = lambda name: "",
) -> str:
    """One line for an operator: what the segments need (largest first, with the flags that
    size them), what is free, what else holds the room (other hisparse files and their owners,
    space held by no visible file, deleted segments still mapped), and the fix."""
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    largest = sorted(wanted.items(), key=lambda kv: -kv[1])
    sizes = ", ".join(
        f"{name} {human(n)}{f' ({sizing(name)})' if sizing(name) else ''}"
        for name, n in largest[:3]
    )
    more = f" and {len(largest) - 3} smaller" if len(largest) > 3 else ""
    held = _held_elsewhere(shm_dir, total - st.f_bfree * st.f_frsize)
    return (
        f"no room for the KV segments in {shm_dir}: they need {human(sum(wanted.values()))} "
        f"({sizes}{more}), {human(free)} of {human(total)} is free{held}. Lower those flags "
        "(or their KVS_* variables), or give the shm filesystem more room (docker: shm_size)"
    )


def _held_elsewhere(shm_dir: str, used: int) -> str:
    """What else uses the filesystem, when anything does: '' or '; ...' clauses."""
    owners: dict[tuple[str, int], int] = {}
    visible = 0
    for entry, m in scan(shm_dir, ANY_RE):
        size = _size(entry)
        visible += size
        key = (m["instance"], int(m["pid"]))
        owners[key] = owners.get(key, 0) + size
    parts = [
        f"instance {inst} pid {pid} holds {human(n)} ({_owner_state(shm_dir, inst, pid)})"
        for (inst, pid), n in sorted(owners.items())
    ]
    hidden = max(0, used - visible)
    if hidden:
        parts.append(
            f"{human(hidden)} is used by files that are not hisparse's or are deleted but "
            "still mapped (an engine holding a dead service's segments lets go when it notices)"
        )
    parts += [
        f"pid {pid} still maps {human(n)} of deleted segments"
        for pid, n in sorted(deleted_mappings(shm_dir).items())
    ]
    return "".join(f"; {p}" for p in parts)


def deleted_mappings(shm_dir: str) -> dict[int, int]:
    """Bytes of deleted hisparse files of `shm_dir` each visible process still maps, by pid.
    Only processes of this PID namespace that we may inspect are seen."""
    prefix = os.path.join(os.path.realpath(shm_dir), "hisparse-")
    found: dict[int, int] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/maps") as f:
                lines = f.read().splitlines() if name.isdigit() else []
        except OSError:
            continue
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix) and parts[5].endswith(" (deleted)"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                found[int(name)] = found.get(int(name), 0) + end - start
    return found


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0


def _owner_state(shm_dir: str, instance: str, pid: int) -> str:
    try:
        held = take_if_dead(lock_path(shm_dir, instance, pid))
    except OSError:
        return "no lock file: owner unknown"
    if held is None:
        return "owner alive"
    os.close(held)
    return "owner dead"


def reserve(fd: int, nbytes: int, path: str) -> None:
    # tmpfs allocates pages on first touch; a full /dev/shm would show up later as SIGBUS in
    # whichever process touches the page. Reserving now turns that into an error here.
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            shm_dir = os.path.dirname(path)
            raise NoRoom(
                no_room_message(shm_dir, {os.path.basename(path): nbytes}, os.statvfs(shm_dir)),
                path,
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        log.warning(
            "%s: cannot reserve %d bytes (%s); pages come on first touch", path, nbytes, e.strerror
        )
