"""The "service-remote-swap" backend: the batch goes into exchange tensors and `swap_fn(layer,
bs, rows_per_request)` runs HiSparseBackend's plan + copy elsewhere (the service, over a unary
RPC); and the in-process swap_fn that does what the service does (tests, benchmarks)."""

from __future__ import annotations

from typing import Callable

import torch

from contract.exchange import EVENT_NAMES, exchange_inputs, exchange_outputs, exchange_specs
from contract.layout import KVLayout
from contract.swap_plan import PlanOutputs, swap_in
from contract.tensors import KVTensors
from engine_client.kv.backend import AttnRows
from engine_client.kv.hisparse import HiSparseBackend
from kernels.kit.kernel_set import KernelSet


def allocate_exchange(
    layout: KVLayout, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros(shape, dtype=dtype, device=device)
        for name, (shape, dtype) in exchange_specs(layout).items()
    }


# swap_fn(layer, batch rows, rows per request)
SwapFn = Callable[[int, int, int], None]


def local_swap_fn(kv: KVTensors, xchg: dict[str, torch.Tensor], kernels: KernelSet) -> SwapFn:
    """A swap_fn that plans and copies in this process on the exchange tensors: what the service
    does on its side of the remote-swap RPC (a shared hot region's step bumped at layer 0)."""

    def swap(layer: int, bs: int, rows_per_request: int = 1) -> None:
        if kv.shared is not None and layer == 0:
            kv.shared.next_step()
        swap_in(
            kv,
            layer,
            exchange_inputs(xchg, bs),
            exchange_outputs(xchg, bs, rows_per_request),
            plan=kernels.swap_plan,
            copy=kernels.miss_copy,
            rows_per_request=rows_per_request,
        )

    return swap


class RemoteSwapBackend(HiSparseBackend):
    """Like HiSparseBackend, but the plan + copy of each layer run in
    `swap_fn(layer, bs, rows_per_request)`.

    Per layer the batch is written to xchg_topk / xchg_seq_lens / xchg_req_slots [:bs], then
    swap_fn runs (exchange tensors and events: kv_service.memory.remote_swap). On CUDA the
    streams are ordered with the service's interprocess events: "xchg_ready" is recorded
    after the inputs
    are written, and the engine's stream waits on "xchg_done" after swap_fn returns; without
    events the stream is synchronized before swap_fn, which must then return only once its
    outputs are final. A host round trip per layer cannot be captured: never graphed."""

    capturable = False

    def __init__(
        self,
        kv: KVTensors,
        swap_fn: SwapFn,
        *,
        kernels: KernelSet,
        xchg: dict[str, torch.Tensor] | None = None,
        events: dict[str, torch.cuda.Event] | None = None,
        max_batch: int | None = None,
        rows_per_request: int = 1,
    ) -> None:
        super().__init__(
            kv, kernels=kernels, max_batch=max_batch, rows_per_request=rows_per_request
        )
        self.capturable = False
        self.xchg = self._checked(xchg)
        if events is not None and set(events) != set(EVENT_NAMES):
            raise ValueError(f"events must be {EVENT_NAMES}, got {sorted(events)}")
        self.swap_fn, self.events = swap_fn, events

    def _checked(self, xchg: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        xchg = xchg if xchg is not None else allocate_exchange(self.layout, self.device)
        for name, (shape, dtype) in exchange_specs(self.layout).items():
            t = xchg.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"exchange tensor {name}: expected contiguous {shape} {dtype}")
        return xchg

    def rebind(self, kv: KVTensors | None, xchg: dict[str, torch.Tensor] | None = None) -> None:
        """As HiSparseBackend.rebind, with the exchange tensors of the new mapping."""
        new_xchg = self._checked(xchg) if kv is not None else {}
        super().rebind(kv)
        self.xchg = new_xchg

    def select(
        self,
        layer: int,
        topk: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        row0: int = 0,
        rows_per_request: int = 1,
    ) -> AttnRows:
        """row0 is always 0: remote swap runs no micro-batches."""
        n, x, G = topk.shape[0], self.xchg, rows_per_request
        x["xchg_topk"][:n].copy_(topk)
        x["xchg_seq_lens"][:n].copy_(seq_lens)
        x["xchg_req_slots"][:n].copy_(req_slots)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and self.events is not None:
            self.events["xchg_ready"].record(stream)
        elif stream is not None:
            stream.synchronize()
        self.swap_fn(layer, n, G)
        if stream is not None and self.events is not None:
            stream.wait_event(self.events["xchg_done"])
        out = exchange_outputs(x, n, G)
        self._count(req_slots, topk, out, G)
        return self._hot(layer, req_slots, out.slots)

    def _count(self, req_slots: torch.Tensor, topk: torch.Tensor, out: PlanOutputs, G: int) -> None:
        """What the plan kernel counts in-stream, counted here: the service's plan has no
        access to this engine's counters. On the device, no sync."""
        self.counters += torch.stack([(topk >= 0).sum(), out.miss_count.sum()])
        self._slot_counts.add(req_slots, topk, out.miss_count, out.miss_rows, G)
