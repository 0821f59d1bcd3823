"""The processes of one benchmark run on one machine: a KV service and either one engine of
role both (colocated) or P prefill engines and D decode engines (disaggregated, --nixl 1 on the
service). Every engine is started from the same layout, model and batch; the prefill engines
hold their own baseline cache of that layout."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.shared.child import SHM_DIR, engine_argv, local_kv, remove_segments, service_extra
from contract import flags
from contract.layout import KVLayout
from engine_client.serve.config import LocalLayout
from engine_client.serve.procs import ManagedProcess, engine_process, service_process
from proto.prefill.v1 import prefill_pb2 as pb
from proto.prefill.v1 import prefill_pb2_grpc as pb_grpc

# Seconds a child may take to serve: on a GPU the engine compiles and captures its graphs.
STARTUP = 900.0


@dataclass(frozen=True)
class Shape:
    """What every engine of a run is given."""

    preset: str
    device: str
    max_batch: int  # decode and colocated engines
    prefill_batch: int  # each prefill engine's prompts at once (its cache's requests)
    prefill_chunk: int
    # The prefill engines' GPUs (CUDA_VISIBLE_DEVICES, round-robin); empty: the service's GPU.
    # A prefill engine holds its own cache (baseline mode), so it may run on any GPU; decode
    # engines map the service's memory and stay on its GPU.
    prefill_gpus: tuple[int, ...] = ()
    # Every engine's speculative flags (bench.disagg --draft-tokens), prefill engines included:
    # they draft after the first token and send the drafts to the decode side.
    speculation: tuple[str, ...] = ()


@dataclass
class Stack:
    """The children (stopped in reverse start order), the decode side's targets (where the
    load goes: the colocated engine, or the decode engines) and the prefill engines'."""

    instance: str
    children: list[ManagedProcess] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)

    def started(self, proc: ManagedProcess) -> ManagedProcess:
        self.children.append(proc.start())
        proc.wait_serving(STARTUP)
        return proc

    def spawned(self, proc: ManagedProcess) -> str:
        """Started, not waited for (`ready`): the engines of a run start side by side."""
        self.children.append(proc.start())
        return proc.target

    def ready(self) -> None:
        for proc in self.children:
            proc.wait_serving(STARTUP)

    def stop(self) -> None:
        for proc in reversed(self.children):
            proc.stop()
        remove_segments(self.instance)


def start(
    workdir: str, lay: KVLayout, shape: Shape, topology: tuple[int, int] | None, source: str
) -> Stack:
    """Colocated (`topology` None) or P prefill and D decode engines (`topology` (P, D))."""
    stack = Stack(f"dsg{os.getpid()}-{os.path.basename(workdir)}")
    nixl = ("--nixl", "1") if topology else ()
    svc = service_process(
        workdir,
        stack.instance,
        flags.to_flags(lay),
        device=shape.device,
        shm_dir=SHM_DIR,
        extra=service_extra(*nixl),
    )
    try:
        uds = stack.started(svc).target.removeprefix("unix:")
        if topology is None:
            stack.decode.append(_engine(stack, workdir, uds, shape, "colocated", []))
        else:
            prefills, decodes = topology
            for i in range(prefills):
                stack.prefill.append(stack.spawned(_prefill(workdir, i, lay, shape, source)))
            # A decode engine needs its peers only for its first prompt: their addresses are
            # known (socket paths) before they serve.
            peers = ["--role", "decode", "--prefill-peer", ",".join(stack.prefill)]
            for i in range(decodes):
                stack.decode.append(_engine(stack, workdir, uds, shape, f"decode{i}", peers))
        stack.ready()
        return stack
    except BaseException:
        stack.stop()
        raise


def _engine(stack: Stack, workdir: str, uds: str, shape: Shape, name: str, role: list[str]) -> str:
    """A service-mode engine (role both, or decode with its peers) spawned; its target."""
    run = ["--device", shape.device, *role, *shape.speculation]
    argv = engine_argv(shape.preset, shape.max_batch, shape.prefill_chunk, run)
    return stack.spawned(engine_process(workdir, "service", service_uds=uds, name=name, extra=argv))


def _prefill(workdir: str, i: int, lay: KVLayout, shape: Shape, source: str) -> ManagedProcess:
    """A prefill engine whose own cache has the service's page size, formats and context."""
    local = LocalLayout(
        max_requests=shape.prefill_batch,
        hot_slots=lay.hot_slots,
        window=lay.window,
        page_size=lay.page_size,
        num_pages=shape.prefill_batch * lay.max_pages_per_request,
        max_context=lay.max_context,
        row_format=lay.row_format,
        index_format=lay.index_format,
    )
    run = [*local_kv(shape.device, local), "--role", "prefill", "--transfer-source", source]
    run += shape.speculation
    argv = engine_argv(shape.preset, shape.prefill_batch, shape.prefill_chunk, run)
    proc = engine_process(workdir, "baseline", name=f"prefill{i}", extra=argv)
    if shape.prefill_gpus:
        proc.env["CUDA_VISIBLE_DEVICES"] = visible_gpu(
            shape.prefill_gpus[i % len(shape.prefill_gpus)]
        )
    return proc


def visible_gpu(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for the child that is to see this process's GPU `index` only (this
    process may itself see a subset of the machine's GPUs)."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return mine.split(",")[index].strip() if mine else str(index)


def prefill_status(target: str) -> pb.StatusResponse:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.PrefillServiceStub(channel).Status(pb.StatusRequest(), timeout=10)


def transfer_totals(targets: list[str]) -> dict[str, Any]:
    """The prefill engines' exports, bytes and write seconds since their start, summed."""
    statuses = [prefill_status(t) for t in targets]
    return {
        "exports": sum(s.exports_written for s in statuses),
        "dropped": sum(s.exports_dropped for s in statuses),
        "bytes": sum(s.bytes_written for s in statuses),
        "seconds": sum(s.transfer_seconds for s in statuses),
        "busy_seconds": sum(s.busy_seconds for s in statuses),
        "region_seconds": {
            name: sum(s.region_seconds.get(name, 0.0) for s in statuses)
            for name in sorted({n for s in statuses for n in s.region_seconds})
        },
        "memory_type": ",".join(sorted({s.memory_type for s in statuses})),
    }
