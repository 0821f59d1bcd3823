"""The engine process: decode.v1.DecodeService over grpc.aio on uvloop (its Generate handler is
`engine_client.serve.servicer`), standard health and reflection, UDS (+ optional TCP): the
engine built, served until SIGTERM/SIGINT, and stopped.

Generate streams one response per token with the request id, per-token timing and (text output)
the text the token releases. The prompt is token ids, text or chat messages (serve/prompt.py
tokenizes it with the engine's vocabulary). The token that ends a request (max tokens, a stop
token or a stop string) carries finished = true, the request's stats and usage; a request that
ends otherwise gets a final response without a token (with any text still held). An engine or
KV-service failure ends the stream with that final ERROR response and then status UNAVAILABLE;
a request that waited longer than --max-queue-wait ends the same way with RESOURCE_EXHAUSTED,
one that can never fit the KV capacity with INVALID_ARGUMENT (nobody should retry it); a failed
compute step with INTERNAL.

Resume (`resume_request_id`): the stream replays every token generated so far, with its index,
then follows live; a client that already has tokens skips the indexes it has. Across an engine
restart this needs `serve --state-file` (see engine_client/loop/state_file.py).

Health is NOT_SERVING until the engine is built, and from the loss of the KV service until the
engine has re-attached to a restarted one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc
from grpc_health.v1.health import aio as health_aio

from contract.listen_address import claim_socket_path
from engine_client.loop.engine import Engine
from engine_client.loop.metrics import EngineMetrics
from engine_client.serve.config import EngineConfig
from engine_client.serve.interceptor import EngineInterceptor
from engine_client.serve.prefill_servicer import PrefillServicer
from engine_client.serve.servicer import DecodeServicer
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc
from proto.prefill.v1 import prefill_pb2_grpc as prefill_grpc
from transport import grpc_server
from transport.gc_heap import freeze_startup_heap

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DecodeService"].full_name
STOP_GRACE_SECONDS = 2.0


async def _set_health(health: health_aio.HealthServicer, serving: bool) -> None:
    await grpc_server.set_health(health, SERVICE_NAME, serving)


def build_server(
    cfg: EngineConfig,
    servicer: DecodeServicer,
    health: health_aio.HealthServicer,
    metrics: EngineMetrics | None = None,
    prefill: PrefillServicer | None = None,
) -> grpc.aio.Server:
    interceptors = [EngineInterceptor(metrics.rpc if metrics is not None else None)]
    server = grpc_server.scaffold(SERVICE_NAME, health, interceptors)
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    if prefill is not None:
        prefill_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    # A socket left by a killed engine is reused; a live engine's, or any other file, is not
    # ours to remove (the KV service's rule, one implementation).
    if cfg.endpoints.uds and claim_socket_path(cfg.endpoints.uds, "--uds", "engine"):
        log.warning("removed stale socket %s", cfg.endpoints.uds)
    old = os.umask(0o177)  # the socket file is created 0600
    try:
        for target in cfg.endpoints.listen_targets:
            server.add_insecure_port(target)
    finally:
        os.umask(old)
    return server


async def _watch_failure(engine: Engine, health: health_aio.HealthServicer) -> None:
    while True:
        await engine.failed.wait()
        log.error("KV service lost: health NOT_SERVING until it is back and re-attached")
        await _set_health(health, False)
        await engine.recovered.wait()
        log.info("KV service re-attached: health SERVING")
        await _set_health(health, True)


async def serve(cfg: EngineConfig) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status."""
    import torch

    from engine_client.serve.factory import build_engine

    torch.set_num_threads(cfg.execution.cpu_threads)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = health_aio.HealthServicer()
    await _set_health(health, False)
    servicer = DecodeServicer(cfg.kv.uses_service)
    metrics = EngineMetrics()  # before the server: its calls are counted from the start
    metrics.gc.install()
    prefill = (
        PrefillServicer(cfg.batching.max_batch) if cfg.disaggregation.role == "prefill" else None
    )
    server = build_server(cfg, servicer, health, metrics, prefill)
    await server.start()
    log.info(
        "listening on %s (NOT_SERVING while the engine is built)",
        ", ".join(cfg.endpoints.listen_targets),
    )
    engine: Engine | None = None
    watcher = None
    stop_metrics = None
    try:
        engine = await build_engine(cfg, metrics)
        servicer.engine = engine
        if prefill is not None:
            prefill.engine, prefill.export = engine, engine.control.export  # type: ignore[attr-defined]
        if cfg.observability.metrics_port is not None:
            (host, port), stop_metrics = engine.metrics.serve(
                cfg.observability.metrics_port, cfg.observability.metrics_address
            )
            log.info("metrics on http://%s:%d/metrics", host, port)
        # Warm (graphs captured): later collections skip the start-up heap.
        log.info("start-up heap frozen: %d objects (transport/gc_heap.py)", freeze_startup_heap())
        engine.start()
        watcher = asyncio.create_task(_watch_failure(engine, health))
        await _set_health(health, True)
        log.info(
            "SERVING: kv mode %s, device %s, max batch %d",
            cfg.kv.kv_mode,
            engine.compute.model.device,
            engine.compute.max_batch,
        )
        await stop.wait()
        log.info("stop requested")
    finally:
        await _set_health(health, False)
        if watcher is not None:
            watcher.cancel()
        if engine is not None:
            # With a state file the requests stay with the service (lease) for a restarted
            # engine to resume; without one they are released now.
            await engine.stop(keep_requests=cfg.kv.resumable)
        await server.stop(STOP_GRACE_SECONDS)
        if stop_metrics is not None:
            stop_metrics()
        if cfg.endpoints.uds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.endpoints.uds)
        log.info("stopped")
    return 0


def run(cfg: EngineConfig) -> int:
    import uvloop

    return uvloop.run(serve(cfg))
