"""The gRPC channel target of an address as users give it: a socket path, `unix:PATH` or
HOST:PORT. Free of gRPC itself, so the CLIs' flag parsing (and their --help) stays light; the
client library (`KVClient`) and every CLI read addresses through it."""

from __future__ import annotations

import os


def grpc_target(address: str) -> str:
    """A gRPC channel target from a socket path (absolute or ./relative), a unix: target or
    HOST:PORT. grpc itself would take a plain path for a DNS name and wait on it."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return "unix:" + os.path.abspath(address)
    return address
