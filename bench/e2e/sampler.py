"""What bench.e2e samples while a phase's streams run: the KV service (GetStats, its Prometheus
/metrics), the engine's /metrics, and the children's GPU and host memory."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import urllib.request

import grpc

from proto.kvcache.v1 import kvcache_pb2 as kpb
from proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc

_RPC_RE = re.compile(
    r"^(kvs_session_message_seconds|grpc_server_handling_seconds)_(sum|count)"
    r"\{([^}]*)\} (\S+)$",
    re.M,
)


def parse_rpc_metrics(text: str) -> dict[str, list[float]]:
    """{method: [seconds, count]} of the service's control-plane messages: Session/* messages
    and RemoteSwap calls (not the Session stream as a whole, GetStats or health), all codes."""
    out: dict[str, list[float]] = {}
    for family, kind, labels, value in _RPC_RE.findall(text):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if family == "kvs_session_message_seconds":
            method = f"Session/{label.get('message', '')}"
        elif label.get("grpc_method") == "RemoteSwap":
            method = "RemoteSwap"
        else:
            continue
        out.setdefault(method, [0.0, 0.0])[0 if kind == "sum" else 1] += float(value)
    return out


_ENGINE_RE = re.compile(
    r"^(engine_step_device_seconds_sum|engine_step_device_seconds_count|"
    r"engine_device_busy_seconds_total|engine_device_idle_seconds_total|"
    r"engine_spec_drafted_tokens_total|engine_spec_accepted_tokens_total|"
    r"engine_swap_misses_total|engine_swap_misses_rows_total|"
    r"engine_admission_limit|engine_admission_best_batch|engine_gc_seconds_total|"
    r"engine_gc_full_collections_total|engine_gc_pause_max_seconds) (\S+)$",
    re.MULTILINE,
)


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The engine's step GPU time (sum, count), GPU busy / idle seconds, speculative drafts,
    swap misses with and without the verify rows' shared plan, its admission limit
    (engine_client.loop.metrics) and its garbage collections (transport/gc_heap.py)."""
    return {name: float(value) for name, value in _ENGINE_RE.findall(text)}


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(ln for ln in f if ln.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


async def _gpu_mib() -> dict[int, int]:
    """Used GPU memory per process (nvidia-smi), {} where unavailable."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        proc = await asyncio.create_subprocess_exec(
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    except (OSError, TimeoutError):
        return {}
    pairs = (line.split(",") for line in out.decode().splitlines() if "," in line)
    return {int(p): int(m) for p, m in pairs if p.strip().isdigit() and m.strip().isdigit()}


async def _scrape(port: int | None) -> str | None:
    """The Prometheus text a child serves on `port`; None without a port or an answer."""
    if port is None:
        return None
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        return await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )
    except OSError:
        return None


class Sampler:
    """Samples every `period` s while running: service counters and control-plane metrics (when
    a service is given), GPU memory and RSS of the children (by name -> pid)."""

    def __init__(
        self,
        kv_target: str | None,
        metrics_port: int | None,
        pids: dict[str, int],
        period: float = 0.1,
        engine_metrics_port: int | None = None,
    ) -> None:
        self.kv_target, self.metrics_port, self.pids = kv_target, metrics_port, pids
        self.engine_metrics_port = engine_metrics_port
        self.period = period
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None

    def start(self) -> None:
        if self.kv_target:
            self._channel = grpc.aio.insecure_channel(self.kv_target)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> list[dict]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        return self.samples

    async def _loop(self) -> None:
        tick = 0
        while True:
            await self._sample(gpu=tick % 10 == 0)  # nvidia-smi takes ~50 ms
            tick += 1
            await asyncio.sleep(self.period)

    async def _sample(self, gpu: bool) -> None:
        s: dict = {"t": time.monotonic(), "rss": {n: _rss_bytes(p) for n, p in self.pids.items()}}
        if gpu:
            used = await _gpu_mib()
            s["gpu_mib"] = {n: used.get(p) for n, p in self.pids.items()}
        if self._channel is not None:
            try:
                st = await kpb_grpc.KVCacheServiceStub(self._channel).GetStats(
                    kpb.GetStatsRequest(), timeout=5
                )
                s["kv"] = {
                    "hits": st.hits,
                    "misses": st.misses,
                    "bytes_moved": st.bytes_moved,
                    "requests": st.requests,
                }
            except grpc.aio.AioRpcError:
                pass
        if (text := await _scrape(self.metrics_port)) is not None:
            s["rpc"] = parse_rpc_metrics(text)
        if (text := await _scrape(self.engine_metrics_port)) is not None:
            s["engine"] = parse_engine_metrics(text)
        self.samples.append(s)
