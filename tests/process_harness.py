"""Multi-process fixtures of the engine tests: a `python -m kv_service` and `python -m
engine_client serve` on sockets in a short temp dir, ready when grpc health says SERVING.

Both run under the supervisor of engine_client.serve.procs, the code the demo and the benchmarks
use;
tests/service_harness.ServiceProcess adds a channel and its own shm dir per service (so leftover
segment files are easy to check).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from contract import flags, setting_groups
from contract.layout import KVLayout
from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream
from engine_client.serve.config import EngineConfig
from engine_client.serve.procs import ManagedProcess, engine_process
from engine_client.serve.settings.local_layout import LocalLayout
from proto.kvcache.v1 import kvcache_pb2 as kpb
from proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc
from proto.prefill.v1 import prefill_pb2 as ppb
from proto.prefill.v1 import prefill_pb2_grpc as ppb_grpc
from tests.service_harness import ServiceProcess, short_tmpdir

# Fits the tiny preset (2 layers, top-k 16). 12 + 12 tokens fit the 32 hot slots (resident);
# longer requests are offloaded and decode through the host tier.
LOCAL = LocalLayout(
    max_requests=4, hot_slots=32, window=8, page_size=8, num_pages=48, max_context=128
)
LAYOUT = LOCAL.layout(num_layers=2, topk=16)


def layout_with(**changes) -> KVLayout:
    return KVLayout(**{**LAYOUT.to_dict(), **changes})


@contextmanager
def workdir(prefix: str = "hse") -> Iterator[str]:
    path = short_tmpdir(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(cuda_shm_dir(path), ignore_errors=True)


def cuda_shm_dir(path: str) -> str:
    """A service on CUDA needs its host tier on tmpfs: since Linux 6.5 cudaHostRegister cannot
    pin a file of another filesystem (/tmp is ext4 on the GPU box). Removed with `workdir`."""
    marker = os.path.basename(tempfile.gettempdir())  # the session's (tests/leftovers.py)
    return os.path.join("/dev/shm", f"{marker}-{os.path.basename(path)}-shm")


# Seconds a child may take to report SERVING: on a GPU the service registers its host tier and
# the engine compiles and captures its kernels first.
STARTUP = {"cpu": 60, "cuda": 300}


def start_service(
    path: str,
    layout: KVLayout = LAYOUT,
    lease: float = 30.0,
    device: str = "cpu",
    unset: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    shm_dir: str | None = None,
) -> ServiceProcess:
    """A SERVING service; `unset`: environment variables the child must not inherit; `extra`:
    more flags (later flags win); `shm_dir`: where its segments go (default: the workdir's own
    on CPU, `cuda_shm_dir` on CUDA)."""
    # The last --device wins over the harness's "--device cpu".
    svc = ServiceProcess(
        path,
        f"t{os.getpid()}x{len(os.listdir(path))}",
        "--lease-seconds",
        str(lease),
        "--drain-timeout",
        "2",
        "--device",
        device,
        *extra,
        layout=layout,
        shm_dir=shm_dir or (cuda_shm_dir(path) if device == "cuda" else None),
    )
    for name in unset:
        svc.env.pop(name, None)
    return svc.start().wait_serving(STARTUP[device])


def start_engine(
    path: str,
    kv_mode: str,
    service: ServiceProcess | None = None,
    name: str = "engine",
    extra: tuple[str, ...] = (),
    device: str = "cpu",
) -> ManagedProcess:
    local = [] if service else flags.to_flags(LOCAL)
    eng = engine_process(
        path,
        kv_mode,
        service_uds=service.uds if service else "",
        name=name,
        extra=["--device", device, "--rpc-timeout", "3", *local, *extra],
    )
    return eng.start().wait_serving(STARTUP[device])


def engine_config(
    kv_mode: str, service: ServiceProcess | None = None, row_format: str = "bf16", **kw
) -> EngineConfig:
    """In-process engine config (tests build the engine with factory.build_engine); row_format
    is the local layout's (baseline/embedded: service modes adopt the service's)."""
    return setting_groups.compose(
        EngineConfig,
        kv_mode=kv_mode,
        uds="/tmp/unused.sock",
        device="cpu",
        service=service.uds if service else "",
        local=dataclasses.replace(LOCAL, row_format=row_format),
        **{"max_batch": 4, "prefill_chunk": 8, "rpc_timeout": 3.0, "admit_retry": 0.1, **kw},
    )


def service_stats(svc: ServiceProcess) -> kpb.GetStatsResponse:
    return kpb_grpc.KVCacheServiceStub(svc.channel).GetStats(kpb.GetStatsRequest(), timeout=5)


def flush(svc: ServiceProcess) -> kpb.FlushResponse:
    """Empty the service's prefix cache (the admin Flush RPC)."""
    return kpb_grpc.KVCacheServiceStub(svc.channel).Flush(kpb.FlushRequest(), timeout=5)


def holds_only_cache(stats: kpb.GetStatsResponse) -> bool:
    """No request left, and every page still used is a cached page no request uses (prefix
    caching keeps them until evicted or flushed)."""
    return (
        stats.requests == 0
        and stats.request_slots.used == 0
        and stats.host_pages.used == stats.cached_pages == stats.evictable_pages
    )


async def wait_until(predicate, timeout: float = 10.0) -> None:
    """Await a condition that an event loop task will make true (no blind sleeping: yield)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def decode_role(*peers: str) -> tuple[str, ...]:
    """A decode engine's flags with `peers` as its prefill peers, reusing cached prompts at the
    prefill chunk's grain: these tests run a prompt on a single node first, and with page-grain
    reuse (the default) its cached pages would make the decode engine prefill it itself
    (DECISIONS, "A prompt mostly cached on the decode side is prefilled there")."""
    return ("--role", "decode", "--prefill-peer", ",".join(peers), "--prefix-reuse-pages", "0")


def prefill_status(eng: ManagedProcess) -> ppb.StatusResponse:
    """What a prefill engine (--role prefill) holds and has moved (prefill.v1 Status)."""
    with grpc.insecure_channel(eng.target) as channel:
        return ppb_grpc.PrefillServiceStub(channel).Status(ppb.StatusRequest(), timeout=5)


def engine_channel(eng: ManagedProcess) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(eng.target)


async def settled(svc: ServiceProcess) -> bool:
    """Whether the service comes to hold only cached pages: an engine releases a request once
    its last step is done, just after the client has had its last token."""
    await wait_until(lambda: holds_only_cache(service_stats(svc)), timeout=10)
    return True


async def generated(eng: ManagedProcess, cfg: GenerateConfig) -> list[int]:
    """The tokens an engine generates for `cfg` (its target is the engine's)."""
    result = GenerationResult()
    async with engine_channel(eng) as channel:
        async for _ in generate_stream(channel, cfg, result):
            pass
    return result.tokens
