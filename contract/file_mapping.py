"""A shared file as this process maps it: one mapping per file, registered with CUDA at most once.

cudaHostRegister records a virtual address range. A range unmapped while still registered stays
registered in the driver, and the next mapping the kernel places over it fails to register with
cudaErrorHostMemoryAlreadyRegistered (712). That is how a test that dropped a mapped tensor
without unmapping it made a later test fail, on some runs only (where mmap put things). So the
registration belongs to the mapping here, not to whoever uses it:
- a file is mapped once per process while any tensor of it lives (`open_file`): a re-attach that
  maps the same files again, or a service and an engine in one process, share that mapping and
  its one registration, never register the same pages twice;
- each user that needs the pages registered pins the mapping once and unpins it once: the first
  pin registers, the last unpin unregisters;
- a mapping still registered when its last tensor goes is unregistered before it is unmapped
  (`FileMapping.__del__` runs before mmap's own munmap), whoever dropped the tensor.
The registrar is the seam to CUDA: `CudaRegistrar` in the product, a fake in CPU tests.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)

_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class HostRegisterError(RuntimeError):
    """The pages of a mapping could not be registered with the GPU."""


class Registrar(Protocol):
    """Registers host pages with a GPU (cudaHostRegister) and undoes it."""

    def register(self, address: int, nbytes: int) -> None:
        """Raises HostRegisterError when the pages cannot be registered."""

    def unregister(self, address: int) -> None:
        """Never raises: it runs while a mapping is dropped."""


@dataclass(frozen=True)
class CudaRegistrar:
    """CUDA's host registration, on one device (the registration is portable to all)."""

    device: torch.device

    def register(self, address: int, nbytes: int) -> None:
        # is_pinned() answers False until ATen's CUDA context is up; the first CUDA allocation
        # does that.
        torch.empty(0, device=self.device)
        start, cudart = time.monotonic(), torch.cuda.cudart()
        with torch.cuda.device(self.device):
            err = int(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_FLAGS))
        if err == ALREADY_REGISTERED:
            raise HostRegisterError(
                f"cudaHostRegister of {nbytes} bytes at {address:#x}: already registered "
                "(cudaError 712) by something outside contract.file_mapping"
            )
        if err != 0:
            raise HostRegisterError(
                f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}; a file "
                "outside tmpfs cannot be pinned on Linux >= 6.5: put --shm-dir on /dev/shm "
                "or another tmpfs"
            )
        log.info(
            "registered %d host bytes with %s in %.2f s",
            nbytes,
            self.device,
            time.monotonic() - start,
        )

    def unregister(self, address: int) -> None:
        torch.cuda.synchronize(self.device)  # no kernel may still be reading these pages
        err = int(torch.cuda.cudart().cudaHostUnregister(address))
        if err != 0:
            log.warning("cudaHostUnregister(%#x) failed with cudaError %d", address, err)


class FileMapping(mmap.mmap):
    """One whole file mapped shared, read-write. `tensor` views it; every tensor keeps the
    mapping alive. Registered while pinned (counted), and never unmapped while registered."""

    def __new__(cls, fd: int, nbytes: int, identity: tuple[int, int]) -> FileMapping:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        return super().__new__(cls, fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)

    def __init__(self, fd: int, nbytes: int, identity: tuple[int, int]) -> None:
        self.nbytes, self.identity = nbytes, identity  # identity: (st_dev, st_ino) as opened
        view = ctypes.c_char.from_buffer(self)
        self.address = ctypes.addressof(view)
        del view  # a buffer export left open would keep the mapping from ever closing
        self.dropped = False  # set once __del__ began: open_file maps the file anew
        self._pins = 0
        self._registrar: Registrar | None = None

    @property
    def registered(self) -> bool:
        return self._registrar is not None

    def tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(self, dtype=dtype, count=numel)

    def pin(self, registrar: Registrar) -> None:
        """One user needs these pages registered: registers them at the first pin."""
        with _lock:
            if self._registrar is None:
                registrar.register(self.address, self.nbytes)
                self._registrar = registrar
            self._pins += 1

    def unpin(self) -> None:
        """One user is done with the registration: unregisters at the last unpin."""
        with _lock:
            if self._pins == 0:
                raise RuntimeError(f"mapping at {self.address:#x} unpinned more than pinned")
            self._pins -= 1
            registrar = self._registrar if self._pins == 0 else None
            if registrar is not None:
                self._registrar = None
        if registrar is not None:
            registrar.unregister(self.address)

    def __del__(self) -> None:
        # Runs before mmap's dealloc unmaps the pages: the range must not stay registered.
        with _lock:
            self.dropped = True
            registrar, self._registrar, self._pins = self._registrar, None, 0
        if registrar is not None:
            try:
                registrar.unregister(self.address)
            except Exception:  # at interpreter exit torch may be gone already
                log.exception("unregistering a dropped mapping at %#x", self.address)


# Reentrant: a mapping may be dropped (its __del__ run) by a collection inside open_file.
_lock = threading.RLock()
_open: weakref.WeakValueDictionary[tuple[int, int, int], FileMapping] = (
    weakref.WeakValueDictionary()
)


def open_file(fd: int) -> FileMapping:
    """This process's mapping of the file `fd` is open on: the live one if there is one (the
    same pages, already registered if pinned), else a new one."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size)
    with _lock:
        mapping = _open.get(key)
        if mapping is None or mapping.dropped:
            mapping = FileMapping(fd, st.st_size, (st.st_dev, st.st_ino))
            _open[key] = mapping
    return mapping
