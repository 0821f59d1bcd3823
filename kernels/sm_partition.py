"""Disjoint SM partitions of one GPU, as CUDA streams (green contexts, driver API >= 12.4).

A stream of a green context runs its kernels only on that context's SMs. torch's
`GreenContext.create(num_sms=...)` takes its SMs afresh for each context, so two of them may
share SMs (pytorch/pytorch#195378); a split of the device's SM resource by
`cuDevSmResourceSplitByCount` gives one group of at least `sms` SMs and the remaining SMs,
disjoint, and a green context and a non-blocking stream on each. The driver rounds `sms` up to
its partition granularity; `SmPartition.sms` says what it gave.

The engine's use (issue 38): the miss copy on a few SMs of its own, the model's kernels on the
rest, so neither waits for the other's CTAs to leave an SM.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import torch
import triton
import triton.language as tl

_SM_TYPE = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 1  # cuGreenCtxCreate must be given it
_STREAM_NON_BLOCKING = 1  # the only flag green streams take
# CUdevResource is 144 bytes in CUDA 12.4 and grows after; a generous buffer each, one
# resource per buffer (no arrays, so its true size never matters). smCount sits at byte 96.
_RESOURCE_BYTES = 512
_SM_COUNT_OFFSET = 96


class SmPartitionError(RuntimeError):
    """The driver cannot partition this device's SMs (too old, or not a CUDA device)."""


@dataclass(frozen=True)
class SmPartition:
    """Two disjoint SM groups of one device: `small` (sms SMs) and `rest`, each a stream."""

    sms: int
    rest_sms: int
    small: torch.cuda.ExternalStream
    rest: torch.cuda.ExternalStream


@triton.jit
def _probe_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), tl.program_id(0) + 1)


def _check_launches(stream: torch.cuda.ExternalStream, what: str) -> None:
    """A Triton kernel and a torch op on `stream`, waited for: the engine launches both kinds on
    these streams, and a driver or Triton that cannot (a module loaded in the primary context,
    launched into a green one) must fail here, at start, with a clear error, not mid-decode."""
    try:
        with torch.cuda.stream(stream):
            out = torch.zeros(4, dtype=torch.int32, device=stream.device)
            _probe_kernel[(4,)](out)
            out.add_(1)
        stream.synchronize()
        ok = out.tolist() == [2, 3, 4, 5]
    except Exception as e:  # Triton's launch errors are RuntimeErrors with the driver's name
        raise SmPartitionError(f"kernels do not run on the {what} SM group's stream: {e}") from e
    if not ok:
        raise SmPartitionError(f"a kernel on the {what} SM group's stream wrote {out.tolist()}")


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise SmPartitionError(f"no CUDA driver library: {e}") from e


def _check(drv: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        drv.cuGetErrorName(rc, ctypes.byref(name))
        raise SmPartitionError(f"{what} failed: {name.value.decode() if name.value else rc}")


def _sm_count(resource: ctypes.Array) -> int:
    return ctypes.c_uint.from_buffer(resource, _SM_COUNT_OFFSET).value


def _green_stream(drv: ctypes.CDLL, dev: ctypes.c_int, resource: ctypes.Array) -> int:
    """A non-blocking stream of a new green context over `resource`; its CUstream handle."""
    desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    _check(drv, drv.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "resource desc")
    _check(
        drv,
        drv.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _GREEN_CTX_DEFAULT_STREAM),
        "cuGreenCtxCreate",
    )
    # The context lives as long as the process: its stream is the handle kept.
    _check(
        drv,
        drv.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, _STREAM_NON_BLOCKING, 0),
        "cuGreenCtxStreamCreate",
    )
    if not stream.value:
        raise SmPartitionError("cuGreenCtxStreamCreate gave no stream")
    return stream.value


def split_sms(sms: int, device: torch.device | int | None = None) -> SmPartition:
    """Partition `device`'s SMs into a group of at least `sms` and the rest (see module doc)."""
    if not torch.cuda.is_available():
        raise SmPartitionError("SM partitions need a CUDA device")
    index = torch.cuda._utils._get_device_index(device, optional=True)
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 1 <= sms < total:
        raise ValueError(f"sms must be in [1, {total}), got {sms}")
    torch.cuda.init()
    drv = _driver()
    dev = ctypes.c_int()
    _check(drv, drv.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    whole, group, rest = (ctypes.create_string_buffer(_RESOURCE_BYTES) for _ in range(3))
    _check(drv, drv.cuDeviceGetDevResource(dev, whole, _SM_TYPE), "cuDeviceGetDevResource")
    groups = ctypes.c_uint(1)
    _check(
        drv,
        drv.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, rest, 0, sms),
        "cuDevSmResourceSplitByCount",
    )
    if groups.value != 1:
        raise SmPartitionError(f"the driver made {groups.value} groups of >= {sms} SMs, not 1")
    small = torch.cuda.ExternalStream(_green_stream(drv, dev, group), device=index)
    other = torch.cuda.ExternalStream(_green_stream(drv, dev, rest), device=index)
    _check_launches(small, "small")
    _check_launches(other, "other")
    return SmPartition(_sm_count(group), _sm_count(rest), small, other)
