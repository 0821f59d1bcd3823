"""The service side of RemoteSwap: one layer's swap-in launched by the service process, for
engines that cannot launch our kernels (and to measure what in-stream swap saves).

The batch inputs and the plan's outputs live in exchange tensors ("xchg_*") that the service
allocates once and exports at attach; one session at a time owns them, because two engines
writing the same inputs would race. On CUDA the service runs on its own stream, ordered with
the engine's stream by two interprocess events: the engine records "xchg_ready" after writing
the inputs and before sending the RPC; the service waits on it, runs the kernels, records
"xchg_done", and the engine's stream waits on that after the reply. On CPU everything is
synchronous.

Each top-k row must hold distinct positions (negative padding may repeat): the plan gives each
missing position one victim, and two copies of one would orphan a slot. Rows of one request
planned together (rows_per_request > 1, a speculative verify step) may share positions: that
plan merges them. Our own top-k never
repeats; rows from other engines are checked here and refused with INVALID_ARGUMENT. On CUDA the
check runs on the device and turns such rows into padding before the plan, so the refusal costs
no extra host sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from contract.errors import CapacityError, InvalidArgument
from contract.exchange import EVENT_NAMES, exchange_outputs, exchange_specs
from contract.layout import MAX_DRAFT_TOKENS
from contract.swap_plan import plan_swap
from contract.tensors import KVTensors


def mask_repeated_rows(
    topk: torch.Tensor, req_slots: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out = req_slots with -1 for the rows of `topk` that repeat a position (negative padding
    may repeat, and padding rows, req_slot < 0, are not looked at); returns how many rows did,
    on the device. O(k log k) per row, no host sync."""
    ordered = torch.sort(topk, dim=1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1) & (
        req_slots >= 0
    )
    out.copy_(req_slots).masked_fill_(repeated, -1)
    return repeated.sum()


@dataclass(frozen=True)
class SwapResult:
    hits: int
    misses: int
    bytes_moved: int
    seconds: float


class RemoteSwapper:
    """Runs swap_plan then miss_copy on the shared KVTensors for the owning session."""

    def __init__(self, kv: KVTensors, exchange: dict[str, torch.Tensor]) -> None:
        for name, (shape, dtype) in exchange_specs(kv.layout).items():
            t = exchange[name]
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != kv.device:
                raise ValueError(f"{name}: expected {shape} {dtype} on {kv.device}")
        self.kv = kv
        self.x = exchange
        # The plan's view of xchg_req_slots: rows with repeated positions become padding (-1).
        self._req_slots = torch.full_like(exchange["xchg_req_slots"], -1)
        self.owner: str | None = None
        self._cuda = kv.device.type == "cuda"
        self.events: dict[str, torch.cuda.Event] = {}
        if self._cuda:
            self.stream = torch.cuda.Stream(kv.device)
            self.events = {
                name: torch.cuda.Event(blocking=False, interprocess=True) for name in EVENT_NAMES
            }
            for event in self.events.values():
                # An event must be recorded once before its IPC handle can be taken.
                event.record(self.stream)

    def warm_up(self) -> None:
        """Compile the kernels before the service reports SERVING: padding rows, so nothing
        is read or written; on CUDA for every rows-per-request the layout can plan (each is
        its own kernel variant; the CPU interpreter compiles nothing)."""
        for g in range(1, MAX_DRAFT_TOKENS + 2 if self._cuda else 2):
            if g > 1 and not self.kv.layout.fits_draft_tokens(g - 1):
                break
            self.x["xchg_req_slots"][:g] = -1
            if self._cuda:
                self.events["xchg_ready"].record(self.stream)
                self._run_cuda(0, g, g)
            else:
                self._launch(0, g, g)

    def event_handles(self) -> list[tuple[str, bytes]]:
        return [(name, event.ipc_handle()) for name, event in self.events.items()]

    def check_free(self, session_id: str) -> None:
        """Raise unless `session_id` ("" for a session not yet created) may own the exchange."""
        if self.owner not in (None, session_id):
            raise CapacityError(
                "remote swap exchange is owned by another session",
                exchanges_needed=1,
                exchanges_free=0,
                exchanges_total=1,
            )

    def claim(self, session_id: str) -> None:
        self.check_free(session_id)
        self.owner = session_id

    def session_closed(self, session_id: str) -> None:
        if self.owner == session_id:
            self.owner = None

    def run(
        self,
        session_id: str,
        layer: int,
        batch_size: int,
        allowed_slots: set[int],
        rows_per_request: int = 1,
    ) -> SwapResult:
        """Swap in `layer` for batch rows [0, batch_size) of the exchange tensors, G =
        rows_per_request consecutive rows per request."""
        lay, G = self.kv.layout, rows_per_request
        self._check_request(session_id, layer, batch_size, G)
        started = time.perf_counter()
        if self._cuda:
            counts = self._run_cuda(layer, batch_size, G)
        else:
            self._check_slots(batch_size, allowed_slots)
            counts = self._launch(layer, batch_size, G)
        hits, misses, repeated = (int(c) for c in counts.tolist())
        if repeated:
            raise InvalidArgument(
                f"{repeated} top-k rows repeat a position; each row must hold "
                "distinct positions (only negative padding may repeat); those "
                "rows were not planned",
                repeated_rows=repeated,
            )
        return SwapResult(hits, misses, misses * lay.row_bytes, time.perf_counter() - started)

    def _check_request(self, session_id: str, layer: int, batch_size: int, G: int) -> None:
        """A RemoteSwap the exchange can run: its owner's, a real layer, whole requests of G
        rows that the layout's hot buffer has room for."""
        lay = self.kv.layout
        if self.owner != session_id:
            raise InvalidArgument(
                "this session does not own the remote swap exchange: attach with remote_swap = true"
            )
        if not 0 <= layer < lay.num_layers:
            raise InvalidArgument(f"layer {layer} outside [0, {lay.num_layers})", layer=layer)
        if not 1 <= G <= MAX_DRAFT_TOKENS + 1:
            raise InvalidArgument(
                f"rows_per_request {G} outside [1, {MAX_DRAFT_TOKENS + 1}]", rows_per_request=G
            )
        if not 1 <= batch_size <= lay.max_requests * G or batch_size % G:
            raise InvalidArgument(
                f"batch_size {batch_size} outside [1, {lay.max_requests * G}] or not a "
                f"multiple of rows_per_request {G}",
                batch_size=batch_size,
            )
        if not lay.fits_draft_tokens(G - 1):
            raise InvalidArgument(
                f"{G} rows per request do not fit this layout: k * G <= B - W and W >= G needed",
                rows_per_request=G,
            )

    def _check_slots(self, batch_size: int, allowed: set[int]) -> None:
        # Kernels bound-check slots, but a session must not plan another session's request.
        # Only on CPU: on CUDA this would cost a device sync before the launch.
        slots = set(self.x["xchg_req_slots"][:batch_size].tolist()) - {-1}
        if not slots <= allowed:
            raise InvalidArgument(
                "req_slots name slots this session does not own", slots=sorted(slots - allowed)
            )

    def _run_cuda(self, layer: int, batch_size: int, rows_per_request: int) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.events["xchg_ready"])
            counts = self._launch(layer, batch_size, rows_per_request)
            self.events["xchg_done"].record(self.stream)
        # The reply carries hits and misses, so the service waits for its own work here.
        self.stream.synchronize()
        return counts

    def _launch(self, layer: int, bs: int, rows_per_request: int) -> torch.Tensor:
        """Plan and copy; returns [hits, misses, repeated rows] on the device, not yet
        synchronized."""
        from kernels.swap.miss_copy import miss_copy
        from kernels.swap.plan import swap_plan

        kv, x, lay = self.kv, self.x, self.kv.layout
        if rows_per_request == 1:
            repeated = mask_repeated_rows(
                x["xchg_topk"][:bs], x["xchg_req_slots"][:bs], self._req_slots[:bs]
            )
        else:  # a shared plan merges repeated positions
            self._req_slots[:bs].copy_(x["xchg_req_slots"][:bs])
            repeated = torch.zeros((), dtype=torch.int64, device=kv.device)
        slots, src, dst, count, rows = exchange_outputs(x, bs, rows_per_request)
        plan_swap(
            swap_plan,
            kv,
            layer,
            (x["xchg_topk"][:bs], x["xchg_seq_lens"][:bs], self._req_slots[:bs]),
            (slots, src, dst, count),
            rows_per_request=rows_per_request,
            miss_rows=rows,
        )
        miss_copy(kv.host_rows, kv.hot_kv, src, dst, count)
        placed = (slots >= 0).sum()
        misses = count.clamp(0, rows_per_request * lay.topk).sum()
        return torch.stack([placed - misses, misses, repeated])
