"""Where the engine serves: its gRPC socket and TCP address, and the OpenAI-compatible HTTP
gateway it may run in the same process."""

from __future__ import annotations

import os
from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, host_port
from engine_client.client.address import ENGINE_SOCKET, default_uds

# sun_path of a sockaddr_un holds 108 bytes including the terminating NUL.
MAX_UDS_PATH_BYTES = 107


def check_uds(path: str) -> None:
    if len(os.fsencode(path)) > MAX_UDS_PATH_BYTES:
        raise ValueError(f"uds path is longer than {MAX_UDS_PATH_BYTES} bytes: {path}")


def _socket_path(name: str, value: str) -> None:
    check_uds(value)


@dataclass(frozen=True)
class Endpoints:
    """The addresses clients reach the engine at; at least one of uds and tcp."""

    uds: str = setting(
        "",
        help="Unix socket path the engine listens on",
        cli_default=lambda env: default_uds(env, ENGINE_SOCKET),
        check=_socket_path,
    )
    tcp: str | None = setting(None, help="also listen on HOST:PORT (insecure)", check=host_port)
    http: str | None = setting(
        None,
        help="also serve the OpenAI-compatible HTTP gateway on HOST:PORT, in this process "
        "(python -m engine_client gateway runs it alone); empty: off",
        check=host_port,
    )
    model_name: str = setting("hisparse", help="the model name the HTTP gateway serves")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.uds and not self.tcp:
            raise ValueError("the engine needs a uds path or a tcp address to listen on")

    @property
    def listen_targets(self) -> list[str]:
        out = [f"unix:{os.path.abspath(self.uds)}"] if self.uds else []
        return out + ([self.tcp] if self.tcp else [])
