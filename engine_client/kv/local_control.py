"""The reference engine's in-process KV controls (`KVControl` without a service process):
- `BaselineControl`: no service; request slots of the engine's own all-on-GPU cache.
- `EmbeddedControl`: a service core (`kv_service.core.ServiceCore`) in this process, on
  locally allocated tensors, called directly (no gRPC). The core is built by
  `engine_client.serve.factory`, the one place the engine imports `kv_service`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from contract.errors import KVError
from contract.layout import MODE_RESIDENT, KVLayout, LayoutError
from contract.tensors import KVTensors
from engine_client.client import errors
from engine_client.client.control import (
    Admission,
    HeldRequest,
    KVStats,
    MemoryUser,
    StepReport,
)


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
            raise errors.InvalidArgument(
                f"prompt_len {prompt_len} + max_new_tokens "
                f"{max_new_tokens} must fit max_context "
                f"{self.layout.max_context}"
            )
        if request_id in self._live:
            raise errors.AlreadyExists(f"request {request_id!r} is already admitted")
        if not self._free:
            raise errors.CapacityError(
                "no free request slot",
                {"slots_free": "0", "slots_total": str(self.layout.max_requests)},
            )
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
    """ServiceCore raises the contract's typed errors (the client's too); prefix the call."""
    try:
        yield
    except KVError as e:
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
        self._call(
            "step_end",
            self.core.step_end,
            list(report.progress),
            report.hits,
            report.misses,
            report.bytes_moved,
        )

    async def release(self, request_id: str) -> None:
        self._call("release", self.core.release, request_id)

    async def stats(self) -> KVStats:
        s = self.core.stats()
        return KVStats(
            pages_used=s.pages_used,
            pages_total=s.pages_total,
            slots_used=s.slots_used,
            slots_total=s.slots_total,
            requests=s.requests,
            hits=s.hits,
            misses=s.misses,
            bytes_moved=s.bytes_moved,
        )

    def check_alive(self) -> None:
        return None

    async def close(self, detach: bool = False) -> None:
        if detach and self.session_id in self.core.sessions:
            self.core.detach(self.session_id)
