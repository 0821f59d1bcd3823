"""The engine's control interface to its KV memory: admit, commit, step end, release.

One protocol (`KVControl`), three implementations, so the engine has a single code path:
- `BaselineControl`: no service; request slots of the engine's own all-on-GPU cache.
- `EmbeddedControl`: a `kv_service.core.ServiceCore` in this process, on locally allocated
  tensors, called directly (no gRPC).
- `kv_client.KVClient`: a separate `python -m kv_service` process over gRPC.

Every implementation raises the typed errors of `engine_client.errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from contract.layout import MODE_RESIDENT, KVLayout, LayoutError
from contract.tensors import KVTensors
from engine_client import errors


@dataclass(frozen=True)
class Admission:
    """A request the KV side accepted: its slot, residency mode and reservation."""

    request_id: str
    slot: int
    mode: int
    reserved_tokens: int
    pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class HeldRequest:
    """A request the service still holds for a resumed session."""

    request_id: str
    slot: int
    mode: int
    seq_len: int
    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class StepReport:
    """Bookkeeping of one decode step: stored lengths and the swap counters of the step."""

    step: int
    progress: tuple[tuple[str, int], ...]
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0


@dataclass(frozen=True)
class KVStats:
    """Occupancy and counters of the KV side, in the units of GetStatsResponse."""

    pages_used: int = 0
    pages_total: int = 0
    slots_used: int = 0
    slots_total: int = 0
    requests: int = 0
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class KVControl(Protocol):
    """What the engine needs from the KV side. `tensors` is None in baseline mode."""

    layout: KVLayout
    tensors: KVTensors | None
    session_id: str
    held: tuple[HeldRequest, ...]

    async def admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> Admission: ...

    async def commit(self, request_id: str, seq_len: int) -> None: ...

    async def step_end(self, report: StepReport) -> None: ...

    async def release(self, request_id: str) -> None: ...

    async def stats(self) -> KVStats: ...

    def check_alive(self) -> None:
        """Raise ServiceUnavailable if the KV memory can no longer be trusted."""

    def let_go(self, user: MemoryUser | None = None) -> None:
        """Once the service is lost: unmap its memory (`user` drops its references first).
        Only between compute steps."""

    async def reattach(self, user: MemoryUser | None = None) -> None:
        """After let_go: wait for a (restarted) service, attach, map, point `user` at it."""

    async def close(self, detach: bool = False) -> None: ...


class MemoryUser(Protocol):
    """What uses the mapped KV memory besides the control (the engine's compute): told to drop
    it (None) when the service is lost, and to use the new mapping after a re-attach."""

    def bind_kv(self, tensors: KVTensors | None, exchange: dict) -> None: ...


class LocalMemory:
    """let_go / reattach of the in-process controls: their memory is never lost."""

    def let_go(self, user: MemoryUser | None = None) -> None:
        return None

    async def reattach(self, user: MemoryUser | None = None) -> None:
        raise errors.ServiceUnavailable("in-process KV memory cannot be re-attached")


class BaselineControl(LocalMemory):
    """Request slots of the engine's own cache; capacity is the slot count."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.tensors = None
        self.session_id = ""
        self.held: tuple[HeldRequest, ...] = ()
        self._free = list(range(layout.max_requests))
        self._live: dict[str, Admission] = {}

    async def admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> Admission:
        tokens = prompt_len + max_new_tokens
        if prompt_len < 1 or max_new_tokens < 0 or tokens > self.layout.max_context:
            raise errors.InvalidArgument(f"prompt_len {prompt_len} + max_new_tokens "
                                         f"{max_new_tokens} must fit max_context "
                                         f"{self.layout.max_context}")
        if request_id in self._live:
            raise errors.AlreadyExists(f"request {request_id!r} is already admitted")
        if not self._free:
            raise errors.CapacityError("no free request slot",
                                       {"slots_free": "0", "slots_total": str(self.layout.max_requests)})
        slot = self._free.pop(0)
        self._live[request_id] = Admission(request_id, slot, MODE_RESIDENT, tokens)
        return self._live[request_id]

    async def commit(self, request_id: str, seq_len: int) -> None:
        self._get(request_id)

    async def step_end(self, report: StepReport) -> None:
        for request_id, _ in report.progress:
            self._get(request_id)

    async def release(self, request_id: str) -> None:
        self._free.append(self._live.pop(self._get(request_id).request_id).slot)
        self._free.sort()

    def _get(self, request_id: str) -> Admission:
        if request_id not in self._live:
            raise errors.UnknownRequest(f"no request {request_id!r}")
        return self._live[request_id]

    async def stats(self) -> KVStats:
        used = len(self._live)
        return KVStats(slots_used=used, slots_total=self.layout.max_requests, requests=used)

    def check_alive(self) -> None:
        return None

    async def close(self, detach: bool = False) -> None:
        self._live.clear()


@contextmanager
def core_errors(what: str) -> Iterator[None]:
    """ServiceCore raises the service's typed errors; give the engine the client's."""
    from kv_service.errors import ServiceError
    try:
        yield
    except ServiceError as e:
        raise e.prefixed(what) from e
    except LayoutError as e:
        raise errors.LayoutMismatch(f"{what}: {e}") from e


class EmbeddedControl(LocalMemory):
    """A ServiceCore in this process. The engine and the core share the event loop's thread,
    which the core requires (it is not thread-safe)."""

    def __init__(self, core, engine_name: str) -> None:
        self.core = core
        self.layout: KVLayout = core.layout
        self.tensors: KVTensors | None = core.kv
        with core_errors("attach"):
            self.session_id = core.attach(engine_name).session_id
        self.held: tuple[HeldRequest, ...] = ()

    def _call(self, what: str, fn: Callable, *args):
        with core_errors(what):
            return fn(self.session_id, *args)

    async def admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> Admission:
        r = self._call("admit", self.core.admit, request_id, prompt_len, max_new_tokens)
        return Admission(r.request_id, r.slot, r.mode, r.reserved_tokens, tuple(r.pages))

    async def commit(self, request_id: str, seq_len: int) -> None:
        self._call("commit", self.core.commit, request_id, seq_len)

    async def step_end(self, report: StepReport) -> None:
        self._call("step_end", self.core.step_end, list(report.progress), report.hits,
                   report.misses, report.bytes_moved)

    async def release(self, request_id: str) -> None:
        self._call("release", self.core.release, request_id)

    async def stats(self) -> KVStats:
        s = self.core.stats()
        return KVStats(pages_used=s.pages_used, pages_total=s.pages_total,
                       slots_used=s.slots_used, slots_total=s.slots_total, requests=s.requests,
                       hits=s.hits, misses=s.misses, bytes_moved=s.bytes_moved)

    def check_alive(self) -> None:
        return None

    async def close(self, detach: bool = False) -> None:
        if detach and self.session_id in self.core.sessions:
            self.core.detach(self.session_id)
