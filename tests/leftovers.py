"""What a test session leaves behind: temporary files, /dev/shm files and processes.

The session gets a private temporary root (TMPDIR and `tempfile.tempdir` point at it, so test
code, `short_tmpdir`, pytest's own tmp_path and every child process put their files there);
other sessions running on the same machine never look like ours. At the end (conftest's
`pytest_sessionfinish`) the run fails when
- anything but pytest's own basetemp (and torch's compile cache) is left in the root;
- /dev/shm holds a new entry of this session: named with the session's marker, or a segment,
  lock or torch IPC counter file of a process this session started (or of pytest itself), or
  the CUDA driver's file (contract.cuda_shm) of a process it started (pytest's own goes at its
  exit: conftest registers that);
- a child process of pytest still runs (it is killed).
Under pytest-xdist each worker is such a session and checks its own root, files and children; it
hands what it found to the controller, which reports it and fails the run (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass, field

from contract import cuda_shm

SHM = "/dev/shm"
# Files named after their creator's pid: hisparse segments and locks, torch's IPC counters.
PID_FILE_RE = re.compile(r"hisparse-[A-Za-z0-9_.-]+?-(?P<pid>[0-9]+)(-[A-Za-z0-9_]+|\.lock)")
TORCH_FILE_RE = re.compile(r"torch_(?P<pid>[0-9]+)_[0-9]+_[0-9]+")
# Processes the harnesses started (services, engines): recorded by their start().
SPAWNED: set[int] = set()
# Not leftovers: pytest's own basetemp and torch's compile cache (both go with the root), and
# Python's multiprocessing resource tracker, a helper that ends when pytest does.
KEPT_TEMP = ("pytest-of-", "torchinductor_")
HELPER_PROCESSES = ("multiprocessing.resource_tracker",)


@dataclass
class Session:
    root: str
    shm_before: set[str] = field(default_factory=set)

    @property
    def marker(self) -> str:
        """The prefix of this session's entries outside its root (/dev/shm dirs)."""
        return os.path.basename(self.root)

    @classmethod
    def begin(cls) -> Session:
        root = tempfile.mkdtemp(prefix="hsrun", dir="/tmp")
        os.environ["TMPDIR"] = root
        tempfile.tempdir = root  # gettempdir() may have been cached by an import already
        return cls(root, set(_listdir(SHM)))

    def leftovers(self, processes: bool = True) -> list[str]:
        """Every leftover, in words; processes found alive are killed (SIGKILL, by pid).
        `processes=False`: files only (pytest-xdist's controller: its children are workers)."""
        left = [
            f"temp: {os.path.join(self.root, n)}"
            for n in sorted(_listdir(self.root))
            if not n.startswith(KEPT_TEMP)
        ]
        ours = SPAWNED | {os.getpid()}
        for name in sorted(set(_listdir(SHM)) - self.shm_before):
            m = PID_FILE_RE.fullmatch(name) or TORCH_FILE_RE.fullmatch(name)
            if name.startswith(self.marker) or (m is not None and int(m["pid"]) in ours):
                left.append(f"/dev/shm: {name}")
            elif (m := cuda_shm.FILE_RE.fullmatch(name)) and int(m["pid"], 16) in SPAWNED:
                # Its supervisor removes it once the process is reaped: one left is a path
                # that skipped that. Removed here, so that the next run starts clean.
                left.append(f"/dev/shm: {name} (the CUDA driver's, of a process this run started)")
                cuda_shm.remove_of(int(m["pid"], 16), SHM)
        # Only our own children: a recorded pid that exited may belong to anyone by now.
        for pid in sorted(children(os.getpid())) if processes else []:
            cmd = _cmdline(pid)
            if alive(pid) and not any(h in cmd for h in HELPER_PROCESSES):
                left.append(f"process {pid}: {cmd}")
                os.kill(pid, signal.SIGKILL)
        return left

    def end(self, keep: bool) -> str | None:
        """Remove the root, unless asked to keep it for a look (and it holds something); return
        its path when kept, for the run's output to name it."""
        if not keep or not _listdir(self.root):
            shutil.rmtree(self.root, ignore_errors=True)
            return None
        return self.root


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running (a zombie is dead: only its exit status waits to be read)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> set[int]:
    out = set()
    for name in _listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and int(fields[1]) == pid:
                out.add(int(name))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"
