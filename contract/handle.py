"""Segment handles: the dict that describes one shared tensor to another process.

One handle dict per tensor travels in the Attach reply:
{"name", "kind": "shm" | "cuda_ipc", "shape", "dtype", "path", "ipc", "nbytes"}.
- "shm": a file in `shm_dir` (normally /dev/shm), named as `shm_file` names it.
- "cuda_ipc": device memory; `ipc` is the storage's CUDA IPC share tuple as JSON (never pickle:
  these bytes arrive over the network). It carries the exporter's pid, as a file name does.
Handles come from another process, so every field is checked before anything is opened.
A file's mapping and its host registration are `file_mapping`'s; what one user mapped is
`segment_map`'s.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import stat

import torch

from contract import file_mapping
from contract.layout import LayoutError

# Segment files: hisparse-<instance>-<pid>-<name> in a shm directory (`kv_service.memory.shm_file`
# creates them and their owner's lock). Instances may contain '-', tensor names may not: the pid
# is the second field from the end.
FILE_RE = re.compile(
    r"hisparse-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>[0-9]+)-(?P<name>[A-Za-z0-9_]+)"
)

# Types of torch's _share_cuda_() tuple, checked before the tuple reaches C++.
_SHARE_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)


def describe(name: str, t: torch.Tensor, path: str) -> dict:
    ipc = b""
    if not path:
        share = t.untyped_storage()._share_cuda_()
        fields = [
            {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v for v in share
        ]
        ipc = json.dumps({"pid": os.getpid(), "share": fields}).encode()
    return {
        "name": name,
        "kind": "shm" if path else "cuda_ipc",
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "path": path,
        "ipc": ipc,
        "nbytes": t.numel() * t.element_size(),
    }


def decode_ipc(ipc: bytes) -> tuple[int, list]:
    try:
        doc = json.loads(ipc)
        pid = doc["pid"]
        share = [
            base64.b64decode(v["b64"], validate=True) if isinstance(v, dict) else v
            for v in doc["share"]
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise LayoutError(f"malformed CUDA IPC handle: {e}") from e
    if (
        type(pid) is not int
        or len(share) != len(_SHARE_TYPES)
        or any(type(v) is not typ for v, typ in zip(share, _SHARE_TYPES))
    ):
        raise LayoutError("malformed CUDA IPC handle")
    return pid, share


def by_name(handles: list[dict]) -> dict[str, dict]:
    named: dict[str, dict] = {}
    for h in handles:
        name = h.get("name") if isinstance(h, dict) else None
        if not isinstance(name, str) or name in named:
            raise LayoutError(f"segment handle without a name, or duplicate: {name!r}")
        named[name] = h
    return named


def check(h: dict) -> tuple[list[int], torch.dtype]:
    """The handle's own consistency; returns its shape and dtype."""
    try:
        shape, dtype = list(h["shape"]), getattr(torch, h["dtype"], None)
        kind, path, ipc, nbytes = h["kind"], h["path"], h["ipc"], h["nbytes"]
    except (KeyError, TypeError) as e:
        raise LayoutError(f"malformed segment handle {h['name']!r}: {e}") from e
    if (
        not isinstance(dtype, torch.dtype)
        or not isinstance(path, str)
        or not isinstance(ipc, bytes)
        or any(type(s) is not int or s < 0 for s in shape)
    ):
        raise LayoutError(f"{h['name']}: bad dtype {h['dtype']!r}, shape {shape} or path/ipc types")
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise LayoutError(f"{h['name']}: {nbytes} bytes do not match {shape} {dtype}")
    shm_ok = kind == "shm" and not ipc and FILE_RE.fullmatch(os.path.basename(path))
    if not shm_ok and not (kind == "cuda_ipc" and not path and ipc):
        raise LayoutError(f"{h['name']}: bad kind {kind!r} for path {path!r}")
    return shape, dtype


def open_tensor(
    h: dict, device: torch.device
) -> tuple[torch.Tensor, file_mapping.FileMapping | None]:
    """The tensor a checked handle names, and for a file this process's mapping of it, whose
    identity tells a file replaced under the same name later from the one opened."""
    shape, dtype = tuple(h["shape"]), getattr(torch, h["dtype"])
    if h["kind"] == "cuda_ipc":
        return _import_cuda(h, shape, dtype, device), None
    fd = os.open(h["path"], os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != h["nbytes"]:
            raise LayoutError(f"{h['path']}: {st.st_size} bytes, handle says {h['nbytes']}")
        mapping = file_mapping.open_file(fd)
    finally:
        os.close(fd)
    return mapping.tensor(math.prod(shape), dtype).view(shape), mapping


def _import_cuda(
    h: dict, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if device.type != "cuda":
        raise LayoutError(f"{h['name']}: CUDA IPC handle cannot be mapped on {device}")
    _, share = decode_ipc(h["ipc"])
    if share[2] != h["nbytes"]:
        raise LayoutError(
            f"{h['name']}: shared storage has {share[2]} bytes, handle says {h['nbytes']}"
        )
    torch.cuda.init()  # the caching allocator opens IPC handles, and it exists only after init
    # The exporter's device index means nothing here: the caller chose its device by GPU UUID.
    share[0] = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(*share)
    strides = [1] * len(shape)  # contiguous, as exported
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape, strides)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs. A zombie does not: a SIGKILLed process stays one until
    its parent reaps it, and its peers see its sockets close before that."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs here: the signal check is all there is
    return state not in ("Z", "X")
