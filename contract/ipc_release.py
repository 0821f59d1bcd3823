"""Closing the CUDA IPC mappings of a lost KV service, and saying who keeps one open.

How torch maps and unmaps (torch 2.x, `torch/csrc/StorageSharing.cpp` and
`c10/cuda/CUDACachingAllocator.cpp`): `UntypedStorage._new_shared_cuda` asks the caching
allocator for the handle's device pointer (`getIpcDevPtr`), which opens the handle once per
process with `cudaIpcOpenMemHandle` and caches it by handle bytes; every storage made from it
holds a shared_ptr to that cache entry, and `cudaIpcCloseMemHandle` runs when the last one goes.
Its deleter also synchronizes the current stream and decrements the exporter's reference counter
in a `/dev/shm/torch_<pid>_*` file, if the exporter still has it. So the mapping is closed
exactly when no storage made from it is alive: no tensor, view or slice of it anywhere. A captured
CUDA graph holds raw addresses, not storages: graphs are dropped by their owner, not here.

`IpcMappings` keeps a weak reference per mapped storage. `unreleased()` collects garbage and
names every storage still alive, with the Python objects that hold it, so that one failed run
tells which tensor leaked and where. A service killed with SIGKILL never unlinks its reference
counter files; `remove_counter_files` does, once the exporter is dead.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import re
import types
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from contract.handle import pid_alive

log = logging.getLogger(__name__)

# torch's process-wide shm handles: "/torch_<pid>_<random>_<counter>" (ATen MapAllocator).
COUNTER_FILE_RE = re.compile(r"/torch_(?P<pid>[0-9]+)_[0-9]+_[0-9]+")
SHM_DIR = "/dev/shm"
# Holders named per leftover tensor: enough to find the leak, bounded for the log line.
MAX_HOLDERS = 6


@dataclass(frozen=True)
class Leftover:
    """A mapped storage still alive after its users let go of it."""

    name: str
    data_ptr: int
    nbytes: int
    holders: tuple[str, ...]

    def __str__(self) -> str:
        held = ", ".join(self.holders) or "no Python object (a C++ reference)"
        return f"{self.name} ({self.nbytes} B at {self.data_ptr:#x}) held by {held}"


@dataclass
class _Mapped:
    ref: StorageWeakRef
    data_ptr: int
    nbytes: int


class IpcMappings:
    """The storages one mapper opened from CUDA IPC handles (any storage works, so the CPU tests
    exercise the same bookkeeping)."""

    def __init__(self) -> None:
        self._mapped: dict[str, _Mapped] = {}

    def __len__(self) -> int:
        return len(self._mapped)

    def add(self, name: str, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self._mapped[name] = _Mapped(StorageWeakRef(s), s.data_ptr(), s.nbytes())

    def unreleased(self) -> list[Leftover]:
        """After every user dropped its references: the storages still alive, with their
        holders. Forgets all of them: the caller reports a leftover once."""
        gc.collect()  # reference cycles (an exception's frames) may hold a tensor
        alive = {n: m for n, m in self._mapped.items() if not m.ref.expired()}
        self._mapped.clear()
        return [
            Leftover(n, m.data_ptr, m.nbytes, holders(m.data_ptr, m.nbytes))
            for n, m in sorted(alive.items())
        ]


def holders(data_ptr: int, nbytes: int) -> tuple[str, ...]:
    """Who holds a tensor whose storage is [data_ptr, data_ptr + nbytes): for each live tensor
    on it, its referrers, described (attribute of an object, list or dict entry, a frame)."""
    tensors = []
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some module objects warn on
        if issubclass(type(obj), torch.Tensor) and _on(obj, data_ptr, nbytes):
            tensors.append(obj)
    found: list[str] = []
    skip = {id(tensors), id(inspect.currentframe())}
    for t in tensors:
        found += _held_by(t, skip)
        if len(found) >= MAX_HOLDERS:
            break
    tensors.clear()
    return tuple(found[:MAX_HOLDERS])


def _held_by(t: torch.Tensor, skip: set[int]) -> list[str]:
    what = f"tensor{list(t.shape)}"
    out = []
    for ref in gc.get_referrers(t):
        if id(ref) not in skip:
            out.append(f"{what} in {_describe(ref, t)}")
    return out or [f"{what} without a Python referrer (a view's base, or held from C++)"]


def _on(t: torch.Tensor, data_ptr: int, nbytes: int) -> bool:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse, ...)
        return False
    return data_ptr <= ptr < data_ptr + max(nbytes, 1)


def _describe(ref: object, held: object) -> str:
    """A referrer in words: `Owner.attr` for an attribute, the key of a dict, a frame's
    function, else the referrer's type."""
    attrs = [k for k, v in getattr(ref, "__dict__", {}).items() if v is held]
    if attrs:
        return f"{type(ref).__qualname__}.{attrs[0]}"
    if isinstance(ref, dict):
        key = next((k for k, v in ref.items() if v is held), "?")
        for owner in gc.get_referrers(ref):
            if getattr(owner, "__dict__", None) is ref:
                return f"{type(owner).__qualname__}.{key}"
        return f"a dict under key {key!r}"
    if isinstance(ref, types.FrameType):
        return f"frame {ref.f_code.co_name} ({ref.f_code.co_filename}:{ref.f_lineno})"
    return type(ref).__qualname__


def remove_counter_files(
    counters: list[tuple[int, str]], shm_dir: str = SHM_DIR
) -> tuple[int, list[tuple[int, str]]]:
    """Unlink torch's reference counter files (exporter pid, name from its IPC handles) of
    exporters that are dead; a live exporter unlinks its own, and one still exiting (or not yet
    reaped) may be tried again later. Returns how many were removed and the entries kept."""
    dead = {pid for pid, _ in counters if not pid_alive(pid)}
    removed = 0
    for name in {name for pid, name in counters if pid in dead}:
        if COUNTER_FILE_RE.fullmatch(name) is None:
            continue  # not a name torch makes: never unlink it
        try:
            os.unlink(os.path.join(shm_dir, name.lstrip("/")))
            removed += 1
        except FileNotFoundError:
            pass
    return removed, [(pid, name) for pid, name in counters if pid not in dead]


def counter_files_of(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """torch's reference counter files that process `pid` created (for a harness that killed it
    before any mapper could clean up)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return [
        f"/{n}"
        for n in names
        if (m := COUNTER_FILE_RE.fullmatch(f"/{n}")) is not None and int(m["pid"]) == pid
    ]
