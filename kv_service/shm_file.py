"""Segment files in a shm directory (normally /dev/shm), named hisparse-<instance>-<pid>-<name>.

The creator's pid in the name is what lets files left by a killed service be found and removed,
and an engine tell that the service whose memory it maps is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import re

import torch

log = logging.getLogger(__name__)

# Instances may contain '-', tensor names may not: the pid is the second field from the end.
FILE_RE = re.compile(r"hisparse-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>[0-9]+)-(?P<name>[A-Za-z0-9_]+)")


def path_for(shm_dir: str, instance: str, name: str) -> str:
    """The file this process creates for tensor `name` of `instance`."""
    return os.path.join(shm_dir, f"hisparse-{instance}-{os.getpid()}-{name}")


def reserve(fd: int, nbytes: int, path: str) -> None:
    # tmpfs allocates pages on first touch; a full /dev/shm would show up later as SIGBUS in
    # whichever process touches the page. Reserving now turns that into an error here.
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no room for {nbytes} bytes in {os.path.dirname(path)} "
                          "(docker: raise shm_size)", path) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        log.warning("%s: cannot reserve %d bytes (%s); pages come on first touch", path, nbytes, e.strerror)


def map_fd(fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Through /proc/self/fd so the mapping is of the file we opened even if its name is unlinked
    # meanwhile: from_file on a missing name would create an empty file instead.
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)


def scan(shm_dir: str) -> list[tuple[os.DirEntry, re.Match]]:
    """Our segment files in shm_dir; a directory that does not exist holds none."""
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return []
    return [(e, m) for e in entries if (m := FILE_RE.fullmatch(e.name))]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    return True


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


def unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except PermissionError as e:
        log.warning("cannot remove %s: %s", path, e)
        return False
