"""The host gather of the staged miss copy: host_gather.c built at first use, its job described
to ctypes, and a checked synchronous call.

The C function runs as a CUDA host function inside the decode step's graph (no Python there: a
callback holding the GIL would wait on the engine's own thread), so it is compiled here, as
Triton compiles its kernels: with the C compiler `CC` names (default gcc, OpenMP), into a cache
directory keyed by the source's hash. Where none builds, `library()` raises HostGatherUnavailable
with the compiler's words, and the engine keeps the SM copy.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("host_gather.c")


class HostGatherUnavailable(RuntimeError):
    """host_gather.c does not build here (no C compiler, or one without OpenMP)."""


class Job(ctypes.Structure):
    """host_gather.c's hg_job: one gather's buffers and flat row range."""

    _fields_ = [
        ("host", ctypes.c_void_p),
        ("host_rows", ctypes.c_int64),
        ("d", ctypes.c_int64),
        ("src", ctypes.c_void_p),
        ("count", ctypes.c_void_p),
        ("groups", ctypes.c_int64),
        ("stride", ctypes.c_int64),
        ("staging", ctypes.c_void_p),
        ("budget", ctypes.c_int64),
        ("first", ctypes.c_int64),
        ("last", ctypes.c_int64),
        ("threads", ctypes.c_int),
    ]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "hisparse-kv"


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """host_gather.c as a shared library, built once per source (HostGatherUnavailable if not)."""
    text = SOURCE.read_bytes()
    cc = os.environ.get("CC", "gcc")
    key = hashlib.sha256(text + cc.encode()).hexdigest()[:16]
    out = _cache_dir() / f"host_gather-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed: a concurrent process never loads half a file.
        # The build directory goes either way (a failed build left it behind before).
        with tempfile.TemporaryDirectory(dir=out.parent) as build:
            tmp = Path(build) / out.name
            cmd = [cc, "-O3", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(tmp)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            except FileNotFoundError:
                raise HostGatherUnavailable(f"no C compiler {cc!r} (set CC)") from None
            except subprocess.CalledProcessError as e:
                err = e.stderr.strip()
                raise HostGatherUnavailable(f"{' '.join(cmd)} failed: {err}") from None
            os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    lib.hg_gather.argtypes = [ctypes.c_void_p]
    lib.hg_gather.restype = None
    return lib


def job(host_rows, src, count, staging, first: int, last: int, threads: int) -> Job:
    """The job of one gather: flat rows [first, last) of the lists src [groups, stride] (int64,
    host row numbers) and count [groups] (int32), from host_rows (uint8, addressed as flat rows
    of staging's width) into staging [budget, D] uint8. Every tensor is host memory; the caller
    keeps them alive as long as the job."""
    d = staging.shape[-1]
    groups, stride = src.shape
    return Job(
        host_rows.data_ptr(),
        host_rows.numel() // d,
        d,
        src.data_ptr(),
        count.data_ptr(),
        groups,
        stride,
        staging.data_ptr(),
        staging.shape[0],
        first,
        last,
        threads,
    )


def _check(host_rows, src, count, staging) -> None:
    for name, x, dtype in (
        ("host_rows", host_rows, torch.uint8),
        ("src", src, torch.int64),
        ("count", count, torch.int32),
        ("staging", staging, torch.uint8),
    ):
        if x.device.type != "cpu" or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"{name}: expected contiguous host {dtype}, got {x.dtype} {x.device}")
    if src.dim() != 2 or tuple(count.shape) != (src.shape[0],) or staging.dim() != 2:
        raise ValueError(
            f"expected src [groups, stride], count [groups], staging [budget, D]: got "
            f"{tuple(src.shape)}, {tuple(count.shape)}, {tuple(staging.shape)}"
        )
    if host_rows.numel() % staging.shape[1]:
        d = staging.shape[1]
        raise ValueError(f"host_rows ({host_rows.numel()} B) is not whole rows of {d} B")


def host_gather(host_rows, src, count, staging, *, first=0, last=None, threads=1) -> None:
    """Staging row f = host row of flat work row f, for f in [first, min(last, total, budget)),
    in the miss copy's flat order (request by request, count clamped to [0, stride]); sources
    outside the tier leave their staging row as it was. Synchronous (the engine's graph calls
    the C function itself, as a host node)."""
    _check(host_rows, src, count, staging)
    last = staging.shape[0] if last is None else last
    j = job(host_rows, src, count, staging, first, last, threads)
    library().hg_gather(ctypes.addressof(j))
