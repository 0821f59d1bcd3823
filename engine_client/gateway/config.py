"""Configuration of the gateway (`python -m engine_client gateway`, flags default to GATEWAY_*
env variables), also built by the CLI's `serve --http` for a gateway inside the engine process."""

from __future__ import annotations

import re
from dataclasses import dataclass

from contract.flags import setting
from engine_client.client.address import engine_target_default, grpc_target

HTTP_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[\w.-]+):(\d{1,5})")


def split_http(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT."""
    m = HTTP_RE.fullmatch(address)
    if m is None or int(m[2]) > 65535:
        raise ValueError(f"http address must be HOST:PORT, got {address!r}")
    return m[1].strip("[]"), int(m[2])


@dataclass(frozen=True)
class GatewayConfig:
    target: str = setting(
        help="engine address: socket path, unix:PATH or HOST:PORT; default GATEWAY_TARGET, "
        "else ENGINE_TARGET, else the engine's default socket",
        parse=grpc_target,
        cli_default=engine_target_default,
    )
    http: str = setting("127.0.0.1:8000", help="HOST:PORT to serve HTTP on (port 0: any free)")
    model_name: str = setting("hisparse", help="the model name of /v1/models and of responses")
    max_tokens: int = setting(
        16,
        help="max_tokens of a completions request that gives none (as OpenAI; chat: the context)",
    )
    timeout: float = setting(600.0, help="deadline in seconds of one generation")
    log_level: str = setting("INFO", help="logging level", parse=str.upper)

    def __post_init__(self) -> None:
        split_http(self.http)
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if not 1 <= self.max_tokens <= 1 << 20:
            raise ValueError(f"max_tokens must be in 1..2^20, got {self.max_tokens}")
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"timeout must be in (0, 86400], got {self.timeout}")
