"""Shared memory segments, the service's side: it exports its KV tensors (and extra tensors);
an engine in another process maps them with `contract.segment_map`.

Each tensor travels in the Attach reply as a handle dict (`contract.handle`):
- "shm": a file in `shm_dir` (normally /dev/shm). The host tier always; every tensor in CPU mode.
  On GPU the exporter registers it with CUDA too (UVA).
- "cuda_ipc": device memory shared by CUDA IPC.
File names carry the creator's pid (`kv_service.memory.shm_file`), and the creator holds a lock file
beside them for its whole life: files left by a killed service of the same instance can be
found and removed (`remove_stale_segments`) without ever touching a live owner's, even one in
another PID namespace; an engine can tell that its service is gone
(`contract.segment_map.SegmentMap.is_owner_alive`). CUDA IPC
handles carry the pid in their JSON for the same reason.

One concept, the export of the service's memory as segments: allocate, export, own (the
lock) and remove; the shm directory's room check is `shm_room.py`, a segment file `shm_file.py`.
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

from contract import file_mapping, handle
from contract.file_mapping import CudaRegistrar, FileMapping
from contract.layout import KVLayout
from contract.segment_map import as_kv_tensors
from contract.shared_region import region_specs
from contract.tensors import KVTensors, tensor_specs
from kv_service.memory import shm_file, shm_room
from kv_service.memory.store import ServiceMemory, clear_all, initialize, service_specs

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9_]+")
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]+")
T = TypeVar("T")


@dataclass
class _SegmentSet:
    """Files and CUDA host registrations (pins on their mappings) made by one create/export
    call, released together."""

    paths: list[str] = field(default_factory=list)
    pinned: list[FileMapping] = field(default_factory=list)

    def release(self) -> None:
        for mapping in self.pinned:
            mapping.unpin()
        self.pinned.clear()
        for path in self.paths:
            if shm_file.unlink_quietly(path):
                log.info("removed segment %s", path)
        self.paths.clear()


# The layout fields (service flags) that size each KV tensor, named when they do not fit.
SIZED_BY = {
    "hot_kv": ("max_requests", "hot_slots", "num_layers", "row_format"),
    "host_kv": ("num_pages", "page_size", "num_layers", "row_format"),
    "index_pool": ("num_pages", "page_size", "num_layers", "index_format"),
    "token_slot": ("max_requests", "max_context", "num_layers"),
    "slot_token": ("max_requests", "hot_slots", "num_layers"),
    "lru_order": ("max_requests", "hot_slots", "num_layers"),
    "page_table": ("max_requests", "max_context", "page_size"),
}


def sizing(layout: KVLayout) -> Callable[[str], str]:
    """`--flag value` of every layout field that sizes a tensor, by tensor name."""
    values = layout.to_dict()

    def flags(name: str) -> str:
        return ", ".join(f"--{f.replace('_', '-')} {values[f]}" for f in SIZED_BY.get(name, ()))

    return flags


_lock = threading.Lock()
_created: dict[tuple[str, str], list[_SegmentSet]] = {}  # (realpath(shm_dir), instance) -> sets
_owner_locks: dict[tuple[str, str], shm_file.OwnerLock] = {}  # same keys


@dataclass
class ServiceSegments:
    """What a service shares, exported: its memory, the handles of its KV tensors, of its
    exchange tensors and of its shared region's tensors (each in the Attach reply of whom may
    use them), and the stale files removed first."""

    memory: ServiceMemory
    kv_handles: list[dict]
    exchange_handles: list[dict]
    region_handles: list[dict]
    removed_stale: list[str]


def export_service_memory(
    layout: KVLayout, device: torch.device, shm_dir: str, instance: str
) -> ServiceSegments:
    """A service's one export at start-up: remove the files of a dead owner of `instance`,
    then allocate every tensor of `memory.service_specs` as shared memory, initialized
    (`memory.initialize`), under one owner lock; `remove_segments` undoes it at exit."""
    start = time.monotonic()
    removed = remove_stale_segments(shm_dir, instance)
    specs = [(n, *spec) for n, spec in service_specs(layout, device).items()]
    memory, handles = _export(
        specs, device, shm_dir, instance, lambda t: initialize(layout, t, device), sizing(layout)
    )
    log.info(
        "exported %d segments of instance %s on %s in %s: %d bytes host, %.2f s",
        len(handles),
        instance,
        device,
        shm_dir,
        layout.host_tier_bytes,
        time.monotonic() - start,
    )
    exchange = [h for h in handles if h["name"] in memory.exchange]
    region = [h for h in handles if h["name"] in region_specs(layout, layout.shared_slots)]
    kv = [h for h in handles if h not in exchange and h not in region]
    return ServiceSegments(memory, kv, exchange, region, removed)


def create_segments(
    layout: KVLayout, device: torch.device | str, shm_dir: str, instance: str
) -> tuple[KVTensors, list[dict]]:
    """Allocate every KV tensor as shared memory, cleared; return them and their handles."""
    device, start = torch.device(device), time.monotonic()
    specs = [
        (name, shape, dtype, device.type == "cpu" or name == "host_kv")
        for name, (shape, dtype) in tensor_specs(layout).items()
    ]

    def prepare(tensors: dict[str, torch.Tensor]) -> KVTensors:
        kv = as_kv_tensors(layout, tensors, device)
        clear_all(kv)
        return kv

    kv, handles = _export(specs, device, shm_dir, instance, prepare, sizing(layout))
    log.info(
        "created %d segments of instance %s on %s in %s: %d bytes host, %d bytes total, %.2f s",
        len(handles),
        instance,
        device,
        shm_dir,
        layout.host_tier_bytes,
        sum(h["nbytes"] for h in handles),
        time.monotonic() - start,
    )
    return kv, handles


def export_extra(
    tensors: dict[str, torch.Tensor], device: torch.device | str, shm_dir: str, instance: str
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Shared copies of `tensors` and their handles. On GPU a CUDA tensor is exported by CUDA IPC
    and a CPU tensor becomes a registered host file; in CPU mode all are files."""
    device = torch.device(device)
    specs = [
        (name, tuple(t.shape), t.dtype, device.type == "cpu" or t.device.type == "cpu")
        for name, t in tensors.items()
    ]
    out, handles = _export(
        specs,
        device,
        shm_dir,
        instance,
        lambda shared: {n: t.copy_(tensors[n]) for n, t in shared.items()},
    )
    log.info("exported %d extra segments of instance %s: %s", len(out), instance, sorted(out))
    return out, handles


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


def _export(
    specs: list[tuple[str, tuple[int, ...], torch.dtype, bool]],
    device: torch.device,
    shm_dir: str,
    instance: str,
    prepare: Callable[[dict[str, torch.Tensor]], T],
    flags: Callable[[str], str] = lambda name: "",
) -> tuple[T, list[dict]]:
    """Allocate (name, shape, dtype, in_file) specs, fill them with `prepare`, describe them.
    `flags(name)`: the settings that size a tensor, for the error when they do not fit."""
    shm_room.check_room(
        shm_dir,
        {
            name: math.prod(shape) * dtype.itemsize
            for name, shape, dtype, in_file in specs
            if in_file
        },
        sizing=flags,
    )
    _hold_owner_lock(shm_dir, instance)
    seg = _SegmentSet()
    try:
        allocs = {
            name: _allocate(name, shape, dtype, device, in_file, shm_dir, instance, seg)
            for name, shape, dtype, in_file in specs
        }
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


def _allocate(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    in_file: bool,
    shm_dir: str,
    instance: str,
    seg: _SegmentSet,
) -> tuple[torch.Tensor, str]:
    """One shared tensor, zeroed: a file (registered with CUDA on GPU), or device memory."""
    numel = math.prod(shape)
    if numel == 0 or not _NAME_RE.fullmatch(name) or not _INSTANCE_RE.fullmatch(instance):
        raise ValueError(
            f"segment {name!r} of instance {instance!r}: needs at least one element, "
            "a name [A-Za-z0-9_]+ and an instance [A-Za-z0-9_.-]+"
        )
    if not in_file:
        return torch.zeros(shape, dtype=dtype, device=device), ""
    path = shm_file.path_for(shm_dir, instance, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    seg.paths.append(path)
    try:
        nbytes = numel * dtype.itemsize
        os.ftruncate(fd, nbytes)
        shm_room.reserve(fd, nbytes, path)
        mapping = file_mapping.open_file(fd)
    finally:
        os.close(fd)
    if device.type == "cuda":
        mapping.pin(CudaRegistrar(device))
        seg.pinned.append(mapping)
    return mapping.tensor(numel, dtype).view(shape), path
