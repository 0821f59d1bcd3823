"""The processes of bench.prefix's runs: at most one kv service (kept, and flushed, while runs
share its layout) and one engine at a time, in one temp dir."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import grpc

from bench.prefix import plan
from bench.shared.child import SHM_DIR, remove_segments, service_extra
from engine_client.serve.procs import ManagedProcess, engine_process, service_process
from engine_client.serve.settings.local_layout import LocalLayout
from proto.kvcache.v1 import kvcache_pb2 as kpb
from proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc


class Procs:
    """At most one kv service (kept, and flushed, while runs share its layout) and one engine
    at a time, in one temp dir."""

    def __init__(self, s: plan.Sizes, timeout: float) -> None:
        self.s, self.timeout = s, timeout
        self.dir = tempfile.mkdtemp(prefix="prefix-", dir="/tmp")
        self.instance = f"pfx{os.getpid()}"
        self.service: ManagedProcess | None = None
        self.service_flags: list[str] = []
        self.engine: ManagedProcess | None = None
        self.n = 0

    def start(
        self, mode: str, lay: LocalLayout, sharing: bool, extra: tuple[str, ...] = ()
    ) -> ManagedProcess:
        self.stop_engine()
        uds = self._service(plan.service_flags(self.s, lay)) if mode != "baseline" else ""
        self.n += 1
        flags = plan.engine_flags(self.s, mode, lay, sharing, list(extra))
        self.engine = engine_process(
            self.dir, mode, service_uds=uds, name=f"e{self.n}", extra=flags
        )
        return self.engine.start().wait_serving(self.timeout)

    def _service(self, flags: list[str]) -> str:
        if self.service is not None and flags == self.service_flags:
            self._call("Flush", kpb.FlushRequest())  # every run starts cold
        else:
            self.stop_service()
            self.service = service_process(
                self.dir,
                self.instance,
                flags,
                device=self.s.device,
                shm_dir=SHM_DIR,
                extra=service_extra(),
            )
            self.service.start().wait_serving(self.timeout)
            self.service_flags = flags
        return self.service.target.removeprefix("unix:")

    def _call(self, method: str, request):
        assert self.service is not None
        with grpc.insecure_channel(self.service.target) as channel:
            return getattr(kpb_grpc.KVCacheServiceStub(channel), method)(request, timeout=10)

    def stats(self) -> dict:
        if self.service is None:
            return {}
        s = self._call("GetStats", kpb.GetStatsRequest())
        keys = ("cached_pages", "prefix_hit_tokens_total", "evicted_pages_total", "admitted_total")
        keys += ("hits", "misses", "shared_rows")  # shared_rows: the region's live rows
        return {k: getattr(s, k) for k in keys}

    def stop_engine(self) -> int:
        code = self.engine.stop() if self.engine is not None else 0
        if code:
            print(f"{self.engine.name} exited with {code}:\n{self.engine.log()}", file=sys.stderr)
        self.engine = None
        return code

    def stop_service(self) -> None:
        if self.service is not None:
            self.service.stop()
        self.service, self.service_flags = None, []

    def close(self) -> list[str]:
        self.stop_engine()
        self.stop_service()
        left = remove_segments(self.instance)
        shutil.rmtree(self.dir, ignore_errors=True)
        return left
