"""The CUDA driver's per-process files in /dev/shm: `cuda.shm.<n>.<pid>.<n>` (4 KiB; after one GPU
test run on the H200, 22 were left, one per process the tests had started). The driver makes
them and only the driver reads them; a process killed with SIGKILL never unlinks its own. Nobody
opens a dead process's file again (its IPC handles died with it), and a live one that already
opened another's keeps its mapping when the name goes, so the name can be removed:
- by the process itself as it exits (`remove_own_at_exit`), after its CUDA work;
- by whoever started it, once it is dead (`remove_of`: `engine_client.serve.procs` after
  reaping a child, the tests for the children they start).
Only the driver can clean what no supervisor of ours saw die: docs/DECISIONS.md.
No torch here: the supervisor imports this without CUDA.
"""

from __future__ import annotations

import atexit
import logging
import os
import re

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# The pid is written in hex (the H200 left cuda.shm.0.3dd.1, cuda.shm.0.48c.1, ...).
FILE_RE = re.compile(r"cuda\.shm\.[0-9a-f]+\.(?P<pid>[0-9a-f]+)\.[0-9a-f]+")


def files_of(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """The driver's files of process `pid`, as paths."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(
        os.path.join(shm_dir, n)
        for n in names
        if (m := FILE_RE.fullmatch(n)) is not None and int(m["pid"], 16) == pid
    )


def remove_of(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the driver's files of `pid`, a process that is gone (or this one, at its exit);
    return those removed."""
    removed = []
    for path in files_of(pid, shm_dir):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove the CUDA driver's file %s: %s", path, e)
    if removed:
        log.info("removed %d CUDA driver files of pid %d", len(removed), pid)
    return removed


def remove_own_at_exit(shm_dir: str = SHM_DIR) -> None:
    """Unlink this process's driver files when it exits normally (Python's exit handlers run
    before the driver's teardown, which ignores a name already gone)."""
    atexit.register(remove_of, os.getpid(), shm_dir)
