"""The control interface an engine has to its KV memory: admit, commit, step end, release,
and the records these calls exchange.

One protocol (`KVControl`), so an engine has a single code path whichever side holds the memory:
- `engine_client.client.KVClient`: a separate `python -m kv_service` process over gRPC (this
  library);
- `engine_client.client.local_control.BaselineControl` / `EmbeddedControl`: the in-process
  controls of the reference engine's baseline and embedded modes (no service process; a
  service core in this process), beside the protocol they implement.

Every implementation raises the typed errors of `contract.errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from contract.layout import KVLayout
from contract.tensors import KVTensors


@dataclass(frozen=True)
class Admission:
    """A request the KV side accepted: its slot, residency mode and reservation."""

    request_id: str
    slot: int
    mode: int
    reserved_tokens: int
    pages: tuple[int, ...] = ()
    # Prompt tokens whose KV came from the prefix cache: prefill starts there.
    cached_tokens: int = 0


@dataclass(frozen=True)
class PrefixLookup:
    """The prefix-cache part of an admission: `contract.prefix.page_hashes` of the prompt's
    full pages, the client's salt, and the reuse granularity in tokens (the prefill chunk:
    cached_tokens is then a multiple of it, so the engine prefills the same chunks as without
    a cached prefix and computes bitwise-identical rows)."""

    page_hashes: tuple[bytes, ...]
    salt: str = ""
    align: int = 0


@dataclass(frozen=True)
class HeldRequest:
    """A request the service still holds for a resumed session."""

    request_id: str
    slot: int
    mode: int
    seq_len: int
    prompt_len: int
    max_new_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class StepReport:
    """Bookkeeping of decode steps: stored lengths and the swap counters of the steps; `steps`
    merged reports (the service bounds the counters by steps x what one step can do)."""

    step: int
    progress: tuple[tuple[str, int], ...]
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    steps: int = 1


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
    # Prefix cache: pages holding a cached page (counted in pages_used), and those of them no
    # request uses (evictable).
    cached_pages: int = 0
    evictable_pages: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class KVControl(Protocol):
    """What the engine needs from the KV side. `tensors` is None in baseline mode."""

    layout: KVLayout
    tensors: KVTensors | None
    session_id: str
    held: tuple[HeldRequest, ...]

    async def admit(
        self,
        request_id: str,
        prompt_len: int,
        max_new_tokens: int,
        prefix: PrefixLookup | None = None,
    ) -> Admission: ...

    async def commit(self, request_id: str, seq_len: int) -> None: ...

    async def step_end(self, report: StepReport) -> None: ...

    async def release(self, request_id: str, page_hashes: Sequence[bytes] = ()) -> None:
        """Free the request; `page_hashes` (every full page of its stored tokens) make its
        written pages shareable first (multi-turn reuse). Empty after a failed step."""

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
