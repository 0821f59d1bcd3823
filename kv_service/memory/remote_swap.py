"""The service side of RemoteSwap: one layer's swap-in launched by the service process, for
engines that cannot launch our kernels (and to measure what in-stream swap saves).

The batch inputs and the plan's outputs live in exchange tensors ("xchg_*") that the service
allocates once and exports at attach; one session at a time owns them, because two engines
writing the same inputs would race. On CUDA the service runs on its own stream, ordered with
the engine's stream by two interprocess events: the engine records "xchg_ready" after writing
the inputs and before sending the RPC; the service waits on it, runs the kernels, records
"xchg_done", and the engine's stream waits on that after the reply. On CPU everything is
synchronous.

Top-k rows from any engine are planned as they come: a row may repeat a position (each missed
position gets one victim and is copied once, every copy reads its slot), and the rows of one
request planned together (rows_per_request > 1, a speculative verify step) may share positions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from contract.errors import CapacityError, InvalidArgument
from contract.exchange import EVENT_NAMES, exchange_inputs, exchange_outputs, exchange_specs
from contract.layout import MAX_DRAFT_TOKENS
from contract.swap_plan import swap_in
from contract.tensors import KVTensors
from kernels.kit.kernel_set import KernelSet
from kv_service.memory.region_lease import RegionLease


@dataclass(frozen=True)
class SwapResult:
    hits: int
    misses: int
    bytes_moved: int
    seconds: float


class RemoteSwapper:
    """Runs swap_plan then miss_copy on the shared KVTensors for the owning session, with the
    shared hot region when that session holds it (`region`; it is bumped to a new step at
    each layer 0: remote swap runs no micro-batches), else on the private slots only."""

    def __init__(
        self, kv: KVTensors, exchange: dict[str, torch.Tensor], region: RegionLease | None = None
    ) -> None:
        for name, (shape, dtype) in exchange_specs(kv.layout).items():
            t = exchange[name]
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != kv.device:
                raise ValueError(f"{name}: expected {shape} {dtype} on {kv.device}")
        self.kv = kv
        self.region = region or RegionLease(None)
        self._private = dataclasses.replace(kv, shared=None)
        self.x = exchange
        self.owner: str | None = None
        self._cuda = kv.device.type == "cuda"
        kernels = KernelSet.choose("auto", kv.device.type)  # chosen once, not per layer
        self._plan, self._copy = kernels.swap_plan, kernels.miss_copy
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
        """A closed session lets go of the exchange and of the shared region."""
        if self.owner == session_id:
            self.owner = None
        self.region.session_closed(session_id)

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
        hits, misses = (int(c) for c in counts.tolist())
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
                f"{G} rows per request do not fit this layout: k * G <= B - W (unless host "
                f"reads; not with a shared region) and W >= G needed",
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
        """Plan and copy; returns [hits, misses] on the device, not yet synchronized."""
        x, lay = self.x, self.kv.layout
        # A step starts at layer 0: where a session waiting for the region takes it if free.
        if self.owner is not None and layer == 0:
            self.region.grant(self.owner)
        kv = self.kv if self.region.holds(self.owner) else self._private
        if kv.shared is not None and layer == 0:
            kv.shared.next_step()
        out = exchange_outputs(x, bs, rows_per_request)
        swap_in(
            kv,
            layer,
            exchange_inputs(x, bs),
            out,
            plan=self._plan,
            copy=self._copy,
            rows_per_request=rows_per_request,
        )
        placed = (out.slots >= 0).sum()
        misses = out.miss_count.clamp(0, rows_per_request * lay.topk).sum()
        # host_reads: entries past the victims (-2 - row) are misses that attention reads from
        # the host tier instead of a copy
        host = (out.slots < -1).sum()
        return torch.stack([placed - misses, misses + host])
