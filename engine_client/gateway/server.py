"""Running the gateway: as its own process (`python -m engine_client gateway`), or started in
another's event loop (`start`: the CLI's `serve --http` runs it beside the engine, see
engine_client/cli/colocation.py), talking to the engine over its gRPC socket either way."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from contract import listen_address
from engine_client.gateway.app import Gateway
from engine_client.gateway.config import GatewayConfig, split_http

log = logging.getLogger(__name__)


async def start(cfg: GatewayConfig) -> tuple[web.AppRunner, str]:
    """Serve the gateway on cfg.http; returns the runner (cleanup() stops it) and the URL it
    listens on (port 0 picks a free port)."""
    host, port = split_http(cfg.http)
    runner = web.AppRunner(Gateway(cfg).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise listen_address.bind_failure("--http", cfg.http, e) from None
    bound_port = runner.addresses[0][1]
    url = f"http://{cfg.http.rsplit(':', 1)[0]}:{bound_port}"
    # Tests and scripts read this line to find a port chosen with port 0.
    log.info("gateway listening on %s (engine %s, model %s)", url, cfg.target, cfg.model_name)
    return runner, url


async def serve(cfg: GatewayConfig) -> int:
    """The gateway alone, until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner, _ = await start(cfg)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("gateway stopped")
    return 0


def run(cfg: GatewayConfig) -> int:
    import uvloop

    return uvloop.run(serve(cfg))
