"""The gRPC channel target of an address as users give it: a socket path, `unix:PATH` or
HOST:PORT, and where the engine listens when nobody says. Free of gRPC itself, so the CLIs' flag
parsing (and their --help) stays light; the client library (`KVClient`), the gateway, the engine
and every CLI read addresses through it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENGINE_SOCKET = "hisparse-engine.sock"


def default_uds(env: Mapping[str, str], name: str) -> str:
    """$XDG_RUNTIME_DIR is per user and not world-writable, so prefer it over /tmp."""
    return str(Path(env.get("XDG_RUNTIME_DIR") or "/tmp") / name)


def engine_target_default(env: Mapping[str, str]) -> str:
    """Where a client finds the engine without a flag: ENGINE_TARGET, else the socket the engine
    listens on by default (serve's --uds)."""
    return env.get("ENGINE_TARGET") or default_uds(env, ENGINE_SOCKET)


def grpc_target(address: str) -> str:
    """A gRPC channel target from a socket path (absolute or ./relative), a unix: target or
    HOST:PORT. grpc itself would take a plain path for a DNS name and wait on it."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return "unix:" + os.path.abspath(address)
    return address
