"""The service process: grpc.aio on uvloop, health, reflection, UDS (+ optional TCP), leases,
metrics, and a graceful drain on SIGTERM.

Start-up order: listen first with health NOT_SERVING (so probes get an answer while a large host
tier is being allocated), allocate and warm up, then SERVING.

One concept, the service process's life: start-up, serving, drain and stop. The per-RPC
translation is `rpc/servicer.py`, the service's logic `core.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
import uvloop
from grpc_health.v1.health import aio as health_aio

from contract.listen_address import AddressTaken, claim_socket_path
from contract.nixl_agent import NixlAgent
from kernels import toolchain
from kv_service.config import ServiceConfig
from kv_service.core import ServiceCore
from kv_service.memory import segment, shm_file, shm_room
from kv_service.memory.region_lease import RegionLease
from kv_service.memory.remote_swap import RemoteSwapper
from kv_service.memory.transfer_agent import kv_agent
from kv_service.rpc.interceptor import ServiceInterceptor
from kv_service.rpc.metrics import ServiceMetrics
from kv_service.rpc.servicer import KVCacheServicer, Runtime
from proto.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc
from transport import grpc_server
from transport.gc_heap import freeze_startup_heap

log = logging.getLogger(__name__)

SERVICE_NAME = kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"].full_name
# Streams still open after the drain get this long to finish before they are cancelled.
STOP_GRACE_SECONDS = 1.0


class StartupError(RuntimeError):
    """The service cannot start for a reason its message states in full (a flag, a file):
    logged as one line, without a traceback."""


# Start-up failures whose message says it all.
ONE_LINE_ERRORS = (StartupError, AddressTaken, shm_room.NoRoom, toolchain.ToolchainError)


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda, but CUDA is not available here: use --device cpu")
    if choice == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID in nvidia-smi's form ("GPU-..."), so engines match CUDA_VISIBLE_DEVICES."""
    if device.type != "cuda":
        return ""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def _check_shm_dir(config: ServiceConfig, device: torch.device) -> None:
    fs = shm_file.fs_type(config.shm_dir)
    if device.type == "cuda" and fs not in shm_file.PINNABLE_FS:
        # Linux >= 6.5 refuses cudaHostRegister's long-term pin of a writable file mapping on
        # other filesystems: allocation would fail with a CUDA error that does not say why.
        log.warning(
            "shm dir %s is on %s, not tmpfs: registering the host tier with CUDA may "
            "fail; use /dev/shm or another tmpfs",
            config.shm_dir,
            fs or "an unknown fs",
        )


def build_runtime(config: ServiceConfig, device: torch.device) -> Runtime:
    """Memory, then segments, once: every shared tensor allocated, initialized and exported in
    one call (kv_service.memory.segment); then the core and the swapper on it, and the warm-up.
    Runs in a worker thread, before the server reports SERVING."""
    shared = segment.export_service_memory(config.layout, device, config.shm_dir, config.instance)
    if shared.removed_stale:
        log.warning(
            "removed %d stale segments of a dead service of instance %s",
            len(shared.removed_stale),
            config.instance,
        )
    kv = shared.memory.kv
    region = RegionLease(kv.shared, shared.region_handles)
    swapper = RemoteSwapper(kv, shared.memory.exchange, region)
    core = ServiceCore(
        kv, lease_seconds=config.lease_seconds, on_session_closed=swapper.session_closed
    )
    if device.type == "cuda":  # the tools the swap kernels compile with, or why not
        log.info("Triton's ptxas: %s", toolchain.check())
    if device.type == "cuda" and config.warmup:
        swapper.warm_up()
        log.info("warm-up: swap kernels compiled and run once")
    agent, landing = kv_agent(config.instance, core.epoch, kv) if config.nixl else (None, None)
    core.ledger.key_landing = landing
    return Runtime(
        agent=agent,
        transfer=agent.target(config.layout) if agent is not None else None,
        core=core,
        handles=shared.kv_handles,
        swapper=swapper,
        exchange_handles=shared.exchange_handles,
        region=region,
        device=device.type,
        gpu_uuid=gpu_uuid(device),
        instance=config.instance,
    )


def _prepare_uds(path: str) -> None:
    """Remove a socket left by a dead service; refuse a live one or a non-socket file."""
    if claim_socket_path(path, "--uds", "service"):
        log.warning("removed stale socket %s", path)


def build_server(
    config: ServiceConfig,
    servicer: KVCacheServicer,
    health: health_aio.HealthServicer,
    metrics: ServiceMetrics,
) -> grpc.aio.Server:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Keepalive pings on an idle connection too, so a vanished peer's lease starts running.
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    interceptors = [ServiceInterceptor(config.token, metrics)]
    server = grpc_server.scaffold(SERVICE_NAME, health, interceptors, options)
    kvcache_pb2_grpc.add_KVCacheServiceServicer_to_server(servicer, server)
    return server


async def _listen(server: grpc.aio.Server, config: ServiceConfig) -> None:
    _prepare_uds(config.uds)
    # The socket file is created with the umask's mode: never let it be wider than asked.
    old = os.umask(0o777 & ~config.socket_mode)
    try:
        server.add_insecure_port(f"unix:{config.uds}")
        if config.tcp:
            server.add_insecure_port(config.tcp)
        await server.start()
    finally:
        os.umask(old)
    os.chmod(config.uds, config.socket_mode)
    tcp = f" and {config.tcp}" if config.tcp else ""
    log.info("listening on unix:%s (mode %o)%s", config.uds, config.socket_mode, tcp)


async def _set_health(health: health_aio.HealthServicer, serving: bool) -> None:
    await grpc_server.set_health(health, SERVICE_NAME, serving)


async def _expire_leases(servicer: KVCacheServicer, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        if servicer.rt.core.expire_leases():
            servicer.changed.set()


async def _drain(
    servicer: KVCacheServicer, health: health_aio.HealthServicer, timeout: float
) -> None:
    core = servicer.rt.core
    log.info(
        "stop requested: draining, %d requests in flight, waiting up to %gs",
        core.num_requests,
        timeout,
    )
    await health.enter_graceful_shutdown()
    core.start_drain()
    if await servicer.wait_idle(timeout):
        log.info("drained: no request left")
    else:
        log.warning(
            "drain timed out with %d requests still admitted; stopping anyway", core.num_requests
        )
    # Until the server stops, an engine's next message learns why its requests are lost.
    servicer.stopping = (
        f"the KV service is stopping (a restart or a shutdown) after its drain of {timeout:g}s "
        f"with {core.num_requests} request(s) still admitted"
    )


@dataclass
class _Started:
    """What serve() must undo, whatever point start-up reached."""

    listening: bool = False
    expiry: asyncio.Task | None = None
    stop_metrics: Callable[[], None] | None = None
    agent: NixlAgent | None = None  # released after the server stopped


async def _bring_up(
    config: ServiceConfig,
    device: torch.device,
    servicer: KVCacheServicer,
    metrics: ServiceMetrics,
    started: _Started,
) -> Runtime:
    runtime = await asyncio.get_running_loop().run_in_executor(None, build_runtime, config, device)
    servicer.ready(runtime)
    started.agent = runtime.agent
    metrics.bind(runtime.core.stats)
    if config.metrics_port is not None:
        started.stop_metrics = metrics.serve(config.metrics_port, config.metrics_address)
        log.info("metrics on http://%s:%d/metrics", config.metrics_address, config.metrics_port)
    started.expiry = asyncio.create_task(
        _expire_leases(servicer, min(config.lease_seconds / 4, 1.0))
    )
    return runtime


async def _shut_down(server: grpc.aio.Server, config: ServiceConfig, started: _Started) -> None:
    if started.expiry is not None:
        started.expiry.cancel()
    await server.stop(STOP_GRACE_SECONDS)
    if started.agent is not None:  # before its memory goes
        started.agent.close()
    segment.remove_segments(config.shm_dir, config.instance)
    if started.listening:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.uds)
    if started.stop_metrics is not None:
        started.stop_metrics()
    log.info("stopped; segments of instance %s removed", config.instance)


async def _serving(
    health: health_aio.HealthServicer, config: ServiceConfig, runtime: Runtime, device: torch.device
) -> None:
    """Warm: freeze the start-up heap (transport/gc_heap.py), SERVING, and the serving line."""
    log.info("start-up heap frozen: %d objects", freeze_startup_heap())
    await _set_health(health, True)
    log.info(
        "SERVING: instance %s, epoch %#x, device %s %s, layout %s",
        config.instance,
        runtime.core.epoch,
        device,
        runtime.gpu_uuid,
        config.layout,
    )


async def serve(config: ServiceConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain and clean up. Returns the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    device = resolve_device(config.device)
    metrics = ServiceMetrics()
    metrics.gc.install()
    health = health_aio.HealthServicer()
    servicer = KVCacheServicer(metrics, on_drain=lambda: _set_health(health, False))
    server = build_server(config, servicer, health, metrics)
    await _set_health(health, False)
    started = _Started()
    try:
        _check_shm_dir(config, device)
        await _listen(server, config)
        started.listening = True
        runtime = await _bring_up(config, device, servicer, metrics, started)
        if not stop.is_set():
            await _serving(health, config, runtime, device)
        await stop.wait()
        await _drain(servicer, health, config.drain_timeout)
    except ONE_LINE_ERRORS as e:
        # Logged here, before the socket closes: whoever watches health and then reads the log
        # must find the cause, not only "stopped".
        log.error("service cannot start: %s", e.strerror if isinstance(e, OSError) else e)
        raise
    except BaseException:
        log.exception("service stopping on an error")
        raise
    finally:
        await _shut_down(server, config, started)
    return 0


def run(config: ServiceConfig) -> int:
    return uvloop.run(serve(config))
