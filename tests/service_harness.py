"""Start `python -m kv_service` as a subprocess on a temp UDS (engine_client.serve.procs supervises
it) and talk to it with the generated client. Readiness comes from grpc health (Watch with a
deadline), never from sleeping."""

from __future__ import annotations

import os
import queue
import socket
import tempfile
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract import flags
from contract.layout import KVLayout
from engine_client.serve.procs import KV_SERVICE_NAME, ManagedProcess, service_command, service_env
from proto.kvcache.v1 import kvcache_pb2 as pb
from proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.leftovers import SPAWNED

TINY = KVLayout(
    num_layers=2,
    max_requests=4,
    hot_slots=16,
    window=4,
    topk=8,
    page_size=4,
    num_pages=32,
    max_context=64,
)
SERVICE = KV_SERVICE_NAME


def short_tmpdir(prefix: str) -> str:
    # A UDS path must fit in 107 bytes; pytest's tmp_path can be longer. The session's own
    # temporary root (tests/leftovers.py) is short.
    return tempfile.mkdtemp(prefix=prefix, dir=tempfile.gettempdir())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServiceProcess(ManagedProcess):
    """One service subprocess with its own socket, shm dir and log, under the shared supervisor
    (engine_client.serve.procs), plus a channel to talk to it."""

    def __init__(
        self,
        workdir: str,
        instance: str,
        *extra: str,
        token: str | None = None,
        layout: KVLayout = TINY,
        shm_dir: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.uds = os.path.join(workdir, "kv.sock")
        self.shm_dir = shm_dir or os.path.join(workdir, "shm")
        os.makedirs(self.shm_dir, exist_ok=True)
        self.instance, self.token, self.layout = instance, token, layout
        args = service_command(
            self.uds,
            instance,
            flags.to_flags(layout),
            device="cpu",
            shm_dir=self.shm_dir,
            extra=extra,
        )
        super().__init__(
            "kv_service",
            args,
            os.path.join(workdir, f"{instance}.log"),
            f"unix:{self.uds}",
            KV_SERVICE_NAME,
            env=service_env(token),
        )
        self.channel: grpc.Channel | None = None

    def start(self) -> ServiceProcess:
        super().start()
        SPAWNED.add(self.proc.pid)  # its /dev/shm files are this session's
        # The socket appears only once the service listens: retry connecting fast meanwhile.
        self.channel = grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 200),
            ],
        )
        return self

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def stub(self) -> pb_grpc.KVCacheServiceStub:
        return pb_grpc.KVCacheServiceStub(self.channel)

    def health_statuses(self, timeout: float = 30.0) -> Iterator[int]:
        """Health statuses of the KV service as they change; the first one at once."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        watch = stub.Watch(
            health_pb2.HealthCheckRequest(service=KV_SERVICE_NAME),
            timeout=timeout,
            wait_for_ready=True,
        )
        for reply in watch:
            yield reply.status

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return super().wait_exit(timeout)
        finally:
            self._close_channel()

    def stop(self, timeout: float = 30.0) -> int:
        try:
            return super().stop(timeout)
        finally:
            self._close_channel()

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def segment_files(self) -> list[str]:
        return sorted(os.listdir(self.shm_dir))

    def log(self, tail: int | None = None) -> str:
        """The whole log by default: tests look for lines written at start-up."""
        return super().log(tail)


class SessionClient:
    """One Session stream; send() returns the reply to that message (replies come in order)."""

    def __init__(
        self,
        svc: ServiceProcess,
        attach: pb.AttachResponse,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self.session_id = attach.session_id
        self.epoch = attach.epoch
        self.seq = 0
        self._outbox: queue.Queue = queue.Queue()
        self._replies = svc.stub().Session(
            iter(self._outbox.get, None),
            timeout=60,
            metadata=svc.metadata if metadata is None else metadata,
        )

    def send(
        self, epoch: int | None = None, session_id: str | None = None, **body
    ) -> pb.SessionReply:
        self.seq += 1
        self._outbox.put(
            pb.SessionMessage(
                seq=self.seq,
                session_id=self.session_id if session_id is None else session_id,
                epoch=self.epoch if epoch is None else epoch,
                **body,
            )
        )
        reply = next(self._replies)
        assert reply.seq == self.seq
        return reply

    def admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> pb.SessionReply:
        return self.send(
            admit=pb.Admit(
                request_id=request_id, prompt_len=prompt_len, max_new_tokens=max_new_tokens
            )
        )

    def release(self, request_id: str) -> pb.SessionReply:
        return self.send(release=pb.Release(request_id=request_id))

    def close(self) -> None:
        """End the stream from our side and wait until the service has ended it too."""
        self._outbox.put(None)
        for _ in self._replies:
            pass


def attach(svc: ServiceProcess, **kw) -> pb.AttachResponse:
    return svc.stub().Attach(pb.AttachRequest(engine_name="test", **kw), metadata=svc.metadata)


def handles_from_proto(tensors) -> list[dict]:
    return [
        {
            "name": t.name,
            "kind": t.kind,
            "shape": list(t.shape),
            "dtype": t.dtype,
            "path": t.shm_path,
            "ipc": t.cuda_ipc,
            "nbytes": t.nbytes,
        }
        for t in tensors
    ]


class RemoteSwapEngine:
    """The engine side of remote swap: maps the service's memory and exchange tensors, writes a
    batch, orders its stream with the service's through the IPC events on CUDA."""

    def __init__(self, svc: ServiceProcess, attach: pb.AttachResponse, device: str) -> None:
        import torch

        from contract.segment_map import SegmentMap

        handles = handles_from_proto(attach.tensors)
        self.svc, self.attach, self.device = svc, attach, torch.device(device)
        self.segments = SegmentMap()
        self.kv = self.segments.map_segments(
            svc.layout, [h for h in handles if not h["name"].startswith("xchg_")], device
        )
        self.x = self.segments.map_extra(
            [h for h in handles if h["name"].startswith("xchg_")], device
        )
        # Ordered by synchronizing, as the engine's RemoteSwapBackend does: opening the
        # exported IPC events with torch 2.11 failed on the H200 (UnicodeDecodeError at record).
        self.sync = self.device.type == "cuda"

    def fill_host(self, slot: int, seq_len: int) -> None:
        """Give every (layer, token) of the request a distinct host row."""
        lay = self.kv.layout
        for t in range(seq_len):
            page = self.kv.page_table[slot, t // lay.page_size].item()
            for layer in range(lay.num_layers):
                self.kv.host_kv[page, layer, t % lay.page_size] = (t * 7 + layer * 3) % 251 + 1

    def host_row(self, slot: int, layer: int, t: int):
        page = self.kv.page_table[slot, t // self.kv.layout.page_size].item()
        return self.kv.host_kv[page, layer, t % self.kv.layout.page_size]

    def swap(
        self, layer: int, slot: int, seq_len: int, topk: list[int], rows_per_request: int = 1
    ) -> pb.RemoteSwapResponse:
        """One request: `rows_per_request` copies of one batch row; raises grpc.RpcError like
        the stub."""
        import torch

        g = rows_per_request
        self.x["xchg_topk"][:g] = torch.tensor(topk, dtype=torch.int32)
        self.x["xchg_seq_lens"][:g] = seq_len
        self.x["xchg_req_slots"][:g] = slot
        if self.sync:
            torch.cuda.synchronize(self.device)
        reply = self.svc.stub().RemoteSwap(
            pb.RemoteSwapRequest(
                session_id=self.attach.session_id,
                epoch=self.attach.epoch,
                layer=layer,
                batch_size=g,
                rows_per_request=g,
            ),
            metadata=self.svc.metadata,
        )
        return reply

    def slots(self) -> list[int]:
        return self.x["xchg_slots"][0].tolist()

    def close(self) -> None:
        """Let go of the mapped memory, as the engine's KVClient does at close."""
        self.segments.unmap(self.kv)
        self.segments.unmap(self.x)
