"""The reference engine's in-process KV controls (`KVControl` without a service process):
- `EmbeddedControl`: a service core (`kv_service.core.ServiceCore`) in this process, on
  locally allocated tensors, called directly (no gRPC).
- `BaselineControl`: no service memory: a service core's bookkeeping (slots, pages, prefix
  cache) over `BaselinePages`, the page table of the engine's own all-on-GPU cache
  (`engine_client.kv.baseline.BaselineBackend`), so the baseline shares cached prefixes with the
  same rules as the service.
The cores are built by `engine_client.serve.factory`, the one place the engine imports
`kv_service`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from contract import errors
from contract.errors import KVError
from contract.layout import KVLayout, LayoutError
from contract.tensors import KVTensors
from engine_client.client.control import (
    Admission,
    HeldRequest,
    KVStats,
    MemoryUser,
    PrefixLookup,
    StepReport,
)


class LocalMemory:
    """let_go / reattach of the in-process controls: their memory is never lost."""

    def let_go(self, user: MemoryUser | None = None) -> None:
        return None

    async def reattach(self, user: MemoryUser | None = None) -> None:
        raise errors.ServiceUnavailable("in-process KV memory cannot be re-attached")


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

    # `core` is a kv_service.core.ServiceCore, built by serve/factory.py: the client wing never
    # imports the service, so it is typed by use here.
    def __init__(self, core: Any, engine_name: str, model_fingerprint: str = "") -> None:
        self.core = core
        self.layout: KVLayout = core.layout
        self.tensors: KVTensors | None = core.kv
        with core_errors("attach"):
            self.session_id = core.attach(engine_name, fingerprint=model_fingerprint).session_id
        self.held: tuple[HeldRequest, ...] = ()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        with core_errors(what):
            return fn(self.session_id, *args)

    async def admit(
        self,
        request_id: str,
        prompt_len: int,
        max_new_tokens: int,
        prefix: PrefixLookup | None = None,
    ) -> Admission:
        p = prefix or PrefixLookup(())
        r = self._call(
            "admit",
            self.core.admit,
            request_id,
            prompt_len,
            max_new_tokens,
            p.page_hashes,
            p.salt,
            p.align,
        )
        return Admission(
            r.request_id, r.slot, r.mode, r.reserved_tokens, tuple(r.pages), r.cached_tokens
        )

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
            report.steps,
        )

    async def release(self, request_id: str, page_hashes: Sequence[bytes] = ()) -> None:
        self._call("release", self.core.release, request_id, page_hashes)

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
            cached_pages=s.cached_pages,
            evictable_pages=s.evictable_pages,
        )

    def check_alive(self) -> None:
        return None

    async def close(self, detach: bool = False) -> None:
        if detach and self.session_id in self.core.table.sessions:
            self.core.detach(self.session_id)


class BaselinePages:
    """The RowStore (kv_service.books.ledger) of the baseline: its page table [R, ppr] int32 on the
    device, which BaselineBackend addresses its KV rows and index keys through. Every row of a
    page is in the one cache every request reads, so a cached prefix needs no copy."""

    def __init__(self, layout: KVLayout, device: torch.device | str) -> None:
        self.layout, self.device = layout, torch.device(device)
        R, ppr = layout.max_requests, layout.max_pages_per_request
        if layout.num_pages != R * ppr:
            raise ValueError(f"the baseline holds {R} x {ppr} pages, not {layout.num_pages}")
        self.page_table = torch.full((R, ppr), -1, dtype=torch.int32, device=self.device)

    def reset(self, slot: int, mode: int, pages: list[int]) -> None:
        row = torch.full((self.layout.max_pages_per_request,), -1, dtype=torch.int32)
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.page_table[slot].copy_(row)

    def load_prefix(self, slot: int, mode: int, pages: list[int], stored: int, cached: int) -> None:
        return None  # the cached rows are in the shared pages already

    def store_pages(self, slot: int, mode: int, pages: list[int], indices: list[int]) -> None:
        return None  # every append wrote its page

    def free(self, slot: int) -> None:
        self.page_table[slot].fill_(-1)

    def sync(self) -> None:
        # The compute thread's next step must see the page table.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class BaselineControl(EmbeddedControl):
    """No service: `core` is a ServiceCore over `BaselinePages`; `page_table` is what the
    baseline backend must address its cache through."""

    def __init__(self, core: Any, engine_name: str, model_fingerprint: str = "") -> None:
        super().__init__(core, engine_name, model_fingerprint)
        self.tensors = None
        self.page_table: torch.Tensor = core.rows.page_table

    async def admit(
        self,
        request_id: str,
        prompt_len: int,
        max_new_tokens: int,
        prefix: PrefixLookup | None = None,
    ) -> Admission:
        if prompt_len + max_new_tokens > self.layout.max_context:
            # As before the baseline used the core: a request longer than the cache's rows.
            raise errors.InvalidArgument(
                f"prompt_len {prompt_len} + max_new_tokens {max_new_tokens} must fit "
                f"max_context {self.layout.max_context}"
            )
        return await super().admit(request_id, prompt_len, max_new_tokens, prefix)
