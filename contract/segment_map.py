"""The engine's side of shared memory: mapping the KV tensors (and extra tensors) a service
exported, unmapping them, and telling whether their owner still lives. The export side is the
service's (`kv_service.memory.segment`); each tensor travels as a handle dict (`contract.handle`).

On GPU each process that maps a "shm" file registers it with CUDA, so kernels load it zero-copy
(UVA): once per mapping, which `contract.file_mapping` shares between every user of one file in
this process; "cuda_ipc" handles are device memory shared by CUDA IPC. File names and IPC handles
carry the exporter's pid: `is_owner_alive` checks it, and the file's identity as mapped.

What was mapped is kept by the `SegmentMap` that mapped it: each KVClient owns one and holds one
pin on each file mapping it registered, so two clients in one process never undo each other's
registrations.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from contract import handle
from contract.file_mapping import CudaRegistrar, FileMapping, Registrar
from contract.ipc_release import IpcMappings
from contract.layout import KVLayout, LayoutError
from contract.tensors import TENSOR_NAMES, KVTensors, tensor_specs
from kernels.uva import UVATensor

log = logging.getLogger(__name__)


class SegmentMap:
    """What one user (a KVClient, a test) mapped of a service's exports: the pins it holds on
    file mappings (by data pointer), each let go exactly once by `unmap`, and the (st_dev,
    st_ino) of each mapped file, which tells a restarted service's new file from the one
    mapped. Thread-safe: the engine's compute thread and its event loop may both ask
    `is_owner_alive`. `registrar`: who registers host pages; CUDA's on a CUDA device when not
    given (a fake one in CPU tests registers even in CPU mode)."""

    def __init__(self, registrar: Registrar | None = None) -> None:
        self._lock = threading.Lock()
        self._registrar = registrar
        self._pinned: dict[int, list[FileMapping]] = {}  # by data_ptr, one entry per pin
        self._files: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) at map time
        # CUDA IPC storages opened here: closed only once none of them is alive.
        self.ipc = IpcMappings()

    def map_segments(
        self, layout: KVLayout, handles: list[dict], device: torch.device | str
    ) -> KVTensors:
        """Map a service's KV tensors in this process, refusing anything the layout does not
        imply."""
        device, specs = torch.device(device), tensor_specs(layout)
        by_name = handle.by_name(handles)
        if set(by_name) != set(specs):
            raise LayoutError(
                f"segment names differ: missing {sorted(set(specs) - set(by_name))}, "
                f"unknown {sorted(set(by_name) - set(specs))}"
            )

        def check(name: str, h: dict) -> None:
            shape, dtype = specs[name]
            kind = "shm" if device.type == "cpu" or name == "host_kv" else "cuda_ipc"
            if handle.check(h) != (list(shape), dtype) or h["kind"] != kind:
                raise LayoutError(
                    f"{name}: layout implies {kind} {list(shape)} {dtype}, handle is "
                    f"{h['kind']} {h['shape']} {h['dtype']}"
                )

        tensors = self._map_all(by_name, device, check)
        try:
            kv = as_kv_tensors(layout, tensors, device)
        except BaseException:
            self.unmap(tensors)
            tensors.clear()  # the traceback keeps this frame: it must not keep the mappings
            raise
        log.info("mapped %d segments on %s", len(by_name), device)
        return kv

    def map_extra(
        self, handles: list[dict], device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Map extra tensors. `device` defaults to CUDA when any handle is CUDA IPC, else CPU."""
        if device is None:
            device = "cuda" if any(h.get("kind") == "cuda_ipc" for h in handles) else "cpu"
        return self._map_all(
            handle.by_name(handles), torch.device(device), lambda name, h: handle.check(h)
        )

    def unmap(self, tensors: KVTensors | dict[str, torch.Tensor]) -> None:
        """Let go of the pins these mapped tensors hold: the last pin of a file mapping
        unregisters its pages. The caller drops its references afterwards; `host_rows` of a
        KVTensors is set to None so that a stray launch fails on the host instead of faulting
        on the GPU."""
        items = (
            [getattr(tensors, n) for n in TENSOR_NAMES]
            if isinstance(tensors, KVTensors)
            else list(tensors.values())
        )
        with self._lock:
            pins = [
                self._pinned[p].pop()
                for p in (t.data_ptr() for t in items if t.device.type == "cpu")
                if self._pinned.get(p)
            ]
        for mapping in pins:
            mapping.unpin()
        if isinstance(tensors, KVTensors):
            tensors.host_rows = None

    def forget_files(self, handles: list[dict]) -> None:
        """Drop what `is_owner_alive` remembers of these handles' files: their mappings are gone.
        A service restarted under the same pid would otherwise look replaced, never alive."""
        with self._lock:
            for h in handles:
                self._files.pop(h.get("path", ""), None)

    def is_owner_alive(self, handles: list[dict]) -> bool:
        """Whether the process that exported these handles still runs and still owns its files
        (the files mapped here, if mapped here). The engine checks this before it trusts a
        step's outputs: a dead service's memory may stay mapped, and reading it must never pass
        for a result."""
        pids = set()
        for h in handles:
            if h["kind"] == "shm":
                m = handle.FILE_RE.fullmatch(os.path.basename(h["path"]))
                if m is None or not self._same_file(h["path"]):
                    return False
                pids.add(int(m["pid"]))
            else:
                pids.add(handle.decode_ipc(h["ipc"])[0])
        return all(handle.pid_alive(pid) for pid in pids)

    def _map_all(
        self, by_name: dict[str, dict], device: torch.device, check: Callable[[str, dict], object]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        try:
            for name, h in by_name.items():
                check(name, h)
                out[name] = self._track(h, device)
        except BaseException:
            self.unmap(out)
            out.clear()  # the traceback keeps this frame: it must not keep the mappings
            raise
        return out

    def _track(self, h: dict, device: torch.device) -> torch.Tensor:
        """Open one handle and record what was mapped: the file's identity for
        `is_owner_alive`, the pin on its mapping for `unmap`."""
        t, mapping = handle.open_tensor(h, device)
        if mapping is None:
            with self._lock:
                self.ipc.add(h["name"], t)
            return t
        with self._lock:
            self._files[h["path"]] = mapping.identity
        registrar = self._registrar or (CudaRegistrar(device) if device.type == "cuda" else None)
        if registrar is not None:
            mapping.pin(registrar)
            with self._lock:
                self._pinned.setdefault(t.data_ptr(), []).append(mapping)
        return t

    def _same_file(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        with self._lock:
            seen = self._files.get(path)
        return seen is None or seen == (st.st_dev, st.st_ino)


def as_kv_tensors(
    layout: KVLayout, tensors: dict[str, torch.Tensor], device: torch.device
) -> KVTensors:
    """The tensors as a KVTensors; on GPU its host rows are a UVA view of the pinned host tier."""
    kv = KVTensors(layout=layout, **tensors)
    if device.type == "cuda":
        kv.host_rows = UVATensor(kv.host_kv)
    return kv
