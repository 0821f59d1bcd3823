"""Shared memory segments: the service exports its KV tensors, an engine in another process maps them.

Each tensor travels in the Attach reply as a handle dict (`kv_service.handle`):
- "shm": a file in `shm_dir` (normally /dev/shm). The host tier always; every tensor in CPU mode.
  On GPU each process that maps it registers it with CUDA, so kernels load it zero-copy (UVA).
- "cuda_ipc": device memory shared by CUDA IPC.
File names carry the creator's pid (`kv_service.shm_file`), and the creator holds a lock file
beside them for its whole life: files left by a killed service of the same instance can be
found and removed (`remove_stale_segments`) without ever touching a live owner's, even one in
another PID namespace; an engine can tell that its service is gone (`is_owner_alive`). CUDA IPC
handles carry the pid in their JSON for the same reason.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kernels.uva import UVATensor
from kv_service import handle, shm_file
from kv_service.layout import KVLayout, LayoutError
from kv_service.memory import TENSOR_NAMES, KVTensors, clear_all, tensor_specs

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9_]+")
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
T = TypeVar("T")


@dataclass
class _SegmentSet:
    """Files and CUDA host registrations made by one create/export call, released together."""

    paths: list[str] = field(default_factory=list)
    # The tensors are kept alive here: unregistering after the munmap would be an error.
    registered: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)

    def release(self) -> None:
        _unregister(self.registered)
        self.registered.clear()
        for path in self.paths:
            if shm_file.unlink_quietly(path):
                log.info("removed segment %s", path)
        self.paths.clear()


_lock = threading.Lock()
_created: dict[tuple[str, str], list[_SegmentSet]] = {}  # (realpath(shm_dir), instance) -> sets
_owner_locks: dict[tuple[str, str], shm_file.OwnerLock] = {}  # same keys
_mapped_registered: dict[int, tuple[torch.Tensor, torch.device]] = {}  # by data_ptr
_mapped_files: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) at map time


def create_segments(layout: KVLayout, device: torch.device | str, shm_dir: str,
                    instance: str) -> tuple[KVTensors, list[dict]]:
    """Allocate every KV tensor as shared memory, cleared; return them and their handles."""
    device, start = torch.device(device), time.monotonic()
    specs = [(name, shape, dtype, device.type == "cpu" or name == "host_kv")
             for name, (shape, dtype) in tensor_specs(layout).items()]

    def prepare(tensors: dict[str, torch.Tensor]) -> KVTensors:
        kv = _as_kv(layout, tensors, device)
        clear_all(kv)
        return kv

    kv, handles = _export(specs, device, shm_dir, instance, prepare)
    log.info("created %d segments of instance %s on %s in %s: %d bytes host, %d bytes total, %.2f s",
             len(handles), instance, device, shm_dir, layout.host_tier_bytes,
             sum(h["nbytes"] for h in handles), time.monotonic() - start)
    return kv, handles


def export_extra(tensors: dict[str, torch.Tensor], device: torch.device | str, shm_dir: str,
                 instance: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Shared copies of `tensors` and their handles. On GPU a CUDA tensor is exported by CUDA IPC
    and a CPU tensor becomes a registered host file; in CPU mode all are files."""
    device = torch.device(device)
    specs = [(name, tuple(t.shape), t.dtype, device.type == "cpu" or t.device.type == "cpu")
             for name, t in tensors.items()]
    out, handles = _export(specs, device, shm_dir, instance,
                           lambda shared: {n: t.copy_(tensors[n]) for n, t in shared.items()})
    log.info("exported %d extra segments of instance %s: %s", len(out), instance, sorted(out))
    return out, handles


def map_segments(layout: KVLayout, handles: list[dict], device: torch.device | str) -> KVTensors:
    """Map a service's KV tensors in this process, refusing anything the layout does not imply."""
    device, specs = torch.device(device), tensor_specs(layout)
    by_name = handle.by_name(handles)
    if set(by_name) != set(specs):
        raise LayoutError(f"segment names differ: missing {sorted(set(specs) - set(by_name))}, "
                          f"unknown {sorted(set(by_name) - set(specs))}")

    def check(name: str, h: dict) -> None:
        shape, dtype = specs[name]
        kind = "shm" if device.type == "cpu" or name == "host_kv" else "cuda_ipc"
        if handle.check(h) != (list(shape), dtype) or h["kind"] != kind:
            raise LayoutError(f"{name}: layout implies {kind} {list(shape)} {dtype}, handle is "
                              f"{h['kind']} {h['shape']} {h['dtype']}")

    tensors = _map_all(by_name, device, check)
    try:
        kv = _as_kv(layout, tensors, device)
    except BaseException:
        unmap_segments(tensors)
        tensors.clear()  # the traceback keeps this frame: it must not keep the mappings
        raise
    log.info("mapped %d segments on %s", len(by_name), device)
    return kv


def map_extra(handles: list[dict], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Map extra tensors. `device` defaults to CUDA when any handle is CUDA IPC, else CPU."""
    if device is None:
        device = "cuda" if any(h.get("kind") == "cuda_ipc" for h in handles) else "cpu"
    return _map_all(handle.by_name(handles), torch.device(device), lambda name, h: handle.check(h))


def unmap_segments(tensors: KVTensors | dict[str, torch.Tensor]) -> None:
    """Unregister the host memory this process registered for these mapped tensors.
    The caller drops its references afterwards; `host_rows` of a KVTensors is set to None so that
    a stray launch fails on the host instead of faulting on the GPU."""
    items = ([getattr(tensors, n) for n in TENSOR_NAMES] if isinstance(tensors, KVTensors)
             else list(tensors.values()))
    with _lock:
        regs = [_mapped_registered.pop(t.data_ptr()) for t in items
                if t.device.type == "cpu" and t.data_ptr() in _mapped_registered]
    _unregister(regs)
    if isinstance(tensors, KVTensors):
        tensors.host_rows = None


def forget_files(handles: list[dict]) -> None:
    """Drop what `is_owner_alive` remembers of these handles' files: their mappings are gone.
    A service restarted under the same pid would otherwise look replaced, never alive."""
    with _lock:
        for h in handles:
            _mapped_files.pop(h.get("path", ""), None)


def remove_segments(shm_dir: str, instance: str) -> None:
    """Unregister and unlink every file this process created for `instance`, then its lock file.
    Only paths it created itself: a file with the same pid in its name may belong to a process
    in another PID namespace. Idempotent."""
    key = (os.path.realpath(shm_dir), instance)
    with _lock:
        sets = _created.pop(key, [])
        owner = _owner_locks.pop(key, None)
    for seg in sets:
        seg.release()
    if owner is not None:
        owner.release()


def remove_stale_segments(shm_dir: str, instance: str) -> list[str]:
    """Remove the files of dead owners of `instance` (their lock can be taken); return their
    paths. Live owners' files, other instances' files, and files without a lock file (a
    version before lock files; removed by hand) are left alone."""
    with _lock:
        mine = (os.path.realpath(shm_dir), instance) in _owner_locks
    return shm_file.remove_stale(shm_dir, instance, skip_pid=os.getpid() if mine else None)


def is_owner_alive(handles: list[dict]) -> bool:
    """Whether the process that exported these handles still runs and still owns its files.
    The engine checks this before it trusts a step's outputs: a dead service's memory may stay
    mapped, and reading it must never pass for a result."""
    pids = set()
    for h in handles:
        if h["kind"] == "shm":
            m = shm_file.FILE_RE.fullmatch(os.path.basename(h["path"]))
            if m is None or not _same_file(h["path"]):
                return False
            pids.add(int(m["pid"]))
        else:
            pids.add(handle.decode_ipc(h["ipc"])[0])
    return all(shm_file.pid_alive(pid) for pid in pids)


def _export(specs: list[tuple[str, tuple[int, ...], torch.dtype, bool]], device: torch.device,
            shm_dir: str, instance: str, prepare: Callable[[dict[str, torch.Tensor]], T]
            ) -> tuple[T, list[dict]]:
    """Allocate (name, shape, dtype, in_file) specs, fill them with `prepare`, describe them."""
    shm_file.check_room(shm_dir, {name: math.prod(shape) * dtype.itemsize
                                  for name, shape, dtype, in_file in specs if in_file})
    _hold_owner_lock(shm_dir, instance)
    seg = _SegmentSet()
    try:
        allocs = {name: _allocate(name, shape, dtype, device, in_file, shm_dir, instance, seg)
                  for name, shape, dtype, in_file in specs}
        prepared = prepare({name: t for name, (t, _) in allocs.items()})
        # Shared after prepare: the IPC event a mapper waits on then covers its writes.
        handles = [handle.describe(name, t, path) for name, (t, path) in allocs.items()]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException:
        seg.release()
        _release_unused_lock(shm_dir, instance)
        raise
    with _lock:
        _created.setdefault((os.path.realpath(shm_dir), instance), []).append(seg)
    return prepared, handles


def _hold_owner_lock(shm_dir: str, instance: str) -> None:
    """Lock before the first file exists, so no segment of ours is ever seen without a lock."""
    if not _INSTANCE_RE.fullmatch(instance):
        raise ValueError(f"instance {instance!r} must match [A-Za-z0-9_.-]+")
    key = (os.path.realpath(shm_dir), instance)
    with _lock:
        if key in _owner_locks:
            return
    owner = shm_file.OwnerLock(shm_dir, instance)
    with _lock:
        _owner_locks[key] = owner


def _release_unused_lock(shm_dir: str, instance: str) -> None:
    key = (os.path.realpath(shm_dir), instance)
    with _lock:
        owner = None if _created.get(key) else _owner_locks.pop(key, None)
    if owner is not None:
        owner.release()


def _map_all(by_name: dict[str, dict], device: torch.device,
             check: Callable[[str, dict], object]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    try:
        for name, h in by_name.items():
            check(name, h)
            out[name] = _track(h, device)
    except BaseException:
        unmap_segments(out)
        out.clear()  # the traceback keeps this frame: it must not keep the mappings
        raise
    return out


def _track(h: dict, device: torch.device) -> torch.Tensor:
    """Open one handle and record what this process mapped: the file's identity for
    `is_owner_alive`, the host registration for `unmap_segments`."""
    t, file_id = handle.open_tensor(h, device)
    if file_id is None:
        return t
    with _lock:
        _mapped_files[h["path"]] = file_id
    if device.type == "cuda":
        _register(t, device)
        with _lock:
            _mapped_registered[t.data_ptr()] = (t, device)
    return t


def _as_kv(layout: KVLayout, tensors: dict[str, torch.Tensor], device: torch.device) -> KVTensors:
    kv = KVTensors(layout=layout, **tensors)
    if device.type == "cuda":
        kv.host_rows = UVATensor(kv.host_kv)
    return kv


def _allocate(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              in_file: bool, shm_dir: str, instance: str, seg: _SegmentSet) -> tuple[torch.Tensor, str]:
    """One shared tensor, zeroed: a file (registered with CUDA on GPU), or device memory."""
    numel = math.prod(shape)
    if numel == 0 or not _NAME_RE.fullmatch(name) or not _INSTANCE_RE.fullmatch(instance):
        raise ValueError(f"segment {name!r} of instance {instance!r}: needs at least one element, "
                         "a name [A-Za-z0-9_]+ and an instance [A-Za-z0-9_.-]+")
    if not in_file:
        return torch.zeros(shape, dtype=dtype, device=device), ""
    path = shm_file.path_for(shm_dir, instance, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    seg.paths.append(path)
    try:
        nbytes = numel * dtype.itemsize
        os.ftruncate(fd, nbytes)
        shm_file.reserve(fd, nbytes, path)
        t = shm_file.map_fd(fd, numel, dtype).view(shape)
    finally:
        os.close(fd)
    if device.type == "cuda":
        _register(t, device)
        seg.registered.append((t, device))
    return t, path


def _register(t: torch.Tensor, device: torch.device) -> None:
    # is_pinned() answers False until ATen's CUDA context is up; the first CUDA allocation does that.
    torch.empty(0, device=device)
    nbytes, start = t.numel() * t.element_size(), time.monotonic()
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _HOST_REGISTER_FLAGS))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}; a "
                           "file outside tmpfs (here: a segment file) cannot be pinned on "
                           "Linux >= 6.5: put --shm-dir on /dev/shm or another tmpfs")
    log.info("registered %d host bytes with %s in %.2f s", nbytes, device, time.monotonic() - start)


def _unregister(regs: list[tuple[torch.Tensor, torch.device]]) -> None:
    for t, device in regs:
        torch.cuda.synchronize(device)  # no kernel may still be reading these pages
        err = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
        if err != 0:
            log.warning("cudaHostUnregister(%#x) failed with cudaError %d", t.data_ptr(), err)


def _same_file(path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    with _lock:
        seen = _mapped_files.get(path)
    return seen is None or seen == (st.st_dev, st.st_ino)
