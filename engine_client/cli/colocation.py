"""`serve --http`: the gateway beside the engine, in the engine's process and event loop. The
composition lives here, in the CLI, so that the gateway stays a plain client of the engine (it
talks to it over the engine's own gRPC socket, as when it runs alone) and imports no serve code."""

from __future__ import annotations

from engine_client.gateway.config import GatewayConfig
from engine_client.gateway.server import start
from engine_client.serve.config import EngineConfig


async def serve_beside_engine(engine_cfg: EngineConfig, cfg: GatewayConfig) -> int:
    """The engine's server (which handles the stop signals) with the gateway in its loop."""
    from engine_client.serve.server import serve as serve_engine

    runner, _ = await start(cfg)
    try:
        return await serve_engine(engine_cfg)
    finally:
        await runner.cleanup()


def beside_engine_config(engine_cfg: EngineConfig) -> GatewayConfig:
    """The gateway of `serve --http`: on the engine's first listening address."""
    if engine_cfg.endpoints.http is None:
        raise ValueError("the engine config has no http address")
    return GatewayConfig(
        target=engine_cfg.endpoints.listen_targets[0],
        http=engine_cfg.endpoints.http,
        model_name=engine_cfg.endpoints.model_name,
        log_level=engine_cfg.observability.log_level,
    )


def run_beside_engine(engine_cfg: EngineConfig) -> int:
    import uvloop

    return uvloop.run(serve_beside_engine(engine_cfg, beside_engine_config(engine_cfg)))
