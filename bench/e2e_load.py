"""Load side of bench/e2e.py: N concurrent decode.v1 Generate streams (spread over worker
processes, so the client is never what limits a few hundred streams), and a sampler of the
KV service (GetStats, Prometheus /metrics) and of the children's GPU and host memory.

A stream's record (plain dict, picklable): submitted time, arrival time of every token (the
system-wide monotonic clock, comparable across processes), the final stats and any error.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import re
import shutil
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import grpc

from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc
from proto.kvcache.v1 import kvcache_pb2 as kpb
from proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc

STREAMS_PER_CHANNEL = 32
# Own subchannels per channel: streams spread over several connections.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


class _Count:
    """Tokens received so far (a shared mp.Value in worker processes)."""

    value = 0


_counter: Any = _Count()


def _init_worker(counter: Any) -> None:
    global _counter
    _counter = counter


def _bump() -> None:
    if isinstance(_counter, _Count):
        _counter.value += 1
        return
    with _counter.get_lock():
        _counter.value += 1


async def _stream(stub: pb_grpc.DecodeServiceStub, req: pb.GenerateRequest, timeout: float) -> dict:
    rec: dict = {
        "submitted": time.monotonic(),
        "arrivals": [],
        "hits": 0,
        "misses": 0,
        "bytes_moved": 0,
        "finish": "",
        "error": "",
        "tokens": [],
    }
    call = stub.Generate(req, timeout=timeout, wait_for_ready=True)
    try:
        async for resp in call:
            if resp.has_token:
                rec["arrivals"].append(time.monotonic())
                rec["tokens"].append(resp.token_id)
                _bump()
            if resp.finished:
                rec["finish"] = pb.FinishReason.Name(resp.finish_reason)
                rec["hits"], rec["misses"] = resp.stats.hits, resp.stats.misses
                rec["bytes_moved"] = resp.stats.bytes_moved
                rec["error"] = resp.error_message
    except grpc.aio.AioRpcError as e:
        rec["error"] = f"{e.code().name}: {e.details()}"
    return rec


def prompt_ids(stream: int, prompt_len: int, vocab: int) -> list[int]:
    """The prompt of stream `stream` of every phase (bench/mtp.py finds recorded tokens by it)."""
    rng = random.Random(stream)
    return [rng.randrange(1, vocab) for _ in range(prompt_len)]


async def run_streams_async(
    target: str, first: int, n: int, prompt_len: int, vocab: int, new_tokens: int, timeout: float
) -> list[dict]:
    channels = [
        grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        for _ in range(-(-n // STREAMS_PER_CHANNEL))
    ]
    try:
        calls = []
        for i in range(first, first + n):
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt_ids(i, prompt_len, vocab)),
                max_new_tokens=new_tokens,
            )
            stub = pb_grpc.DecodeServiceStub(channels[(i - first) // STREAMS_PER_CHANNEL])
            calls.append(_stream(stub, req, timeout))
        return list(await asyncio.gather(*calls))
    finally:
        for ch in channels:
            await ch.close()


def run_streams(*args: Any) -> list[dict]:
    """Worker-process entry point."""
    return asyncio.run(run_streams_async(*args))


def _noop() -> None:
    return None


class LoadGen:
    """Streams from `procs` worker processes (1: in this process)."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.pool: ProcessPoolExecutor | None = None
        if procs > 1:
            ctx = mp.get_context("spawn")  # never fork a process that holds grpc state
            self.counter: Any = ctx.Value("q", 0)
            self.pool = ProcessPoolExecutor(
                procs, mp_context=ctx, initializer=_init_worker, initargs=(self.counter,)
            )
            for f in [self.pool.submit(_noop) for _ in range(procs)]:
                f.result()  # start and import now, not inside a timed phase
        else:
            self.counter = _counter

    @property
    def received(self) -> int:
        return int(self.counter.value)

    async def run(
        self, target: str, n: int, prompt_len: int, vocab: int, new_tokens: int, timeout: float
    ) -> list[dict]:
        self.counter.value = 0
        if self.pool is None:
            return await run_streams_async(target, 0, n, prompt_len, vocab, new_tokens, timeout)
        loop = asyncio.get_running_loop()
        shares = [n // self.procs + (i < n % self.procs) for i in range(self.procs)]
        starts = [sum(shares[:i]) for i in range(self.procs)]
        futs = [
            loop.run_in_executor(
                self.pool, run_streams, target, s, k, prompt_len, vocab, new_tokens, timeout
            )
            for s, k in zip(starts, shares)
            if k
        ]
        return [rec for part in await asyncio.gather(*futs) for rec in part]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


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
    r"engine_admission_limit|engine_admission_best_batch) (\S+)$",
    re.MULTILINE,
)


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The engine's step GPU time (sum, count), GPU busy / idle seconds, speculative drafts,
    swap misses with and without the verify rows' shared plan, and its admission limit
    (engine_client.loop.metrics)."""
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
        if self.metrics_port is not None:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            try:
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(url, timeout=5).read().decode()
                )
                s["rpc"] = parse_rpc_metrics(text)
            except OSError:
                pass
        if self.engine_metrics_port is not None:
            url = f"http://127.0.0.1:{self.engine_metrics_port}/metrics"
            try:
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(url, timeout=5).read().decode()
                )
                s["engine"] = parse_engine_metrics(text)
            except OSError:
                pass
        self.samples.append(s)
