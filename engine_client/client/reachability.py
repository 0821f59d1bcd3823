"""Waiting for a gRPC server to accept connections, and saying plainly why one does not.

A call with wait_for_ready waits out its whole deadline on an address where nothing listens, and
then reports only DEADLINE_EXCEEDED. The CLIs instead wait a few seconds for the channel, then
fail with the address and the likely fix (`Unreachable`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import grpc

from engine_client.client import errors


class Unreachable(errors.ServiceUnavailable):
    """Nothing accepted a connection at the address within the connect timeout."""


@dataclass(frozen=True)
class Peer:
    """Who should listen at an address: `what` names it, `flag` is where the user sets the
    address, `start` how to start it (with {path} for a socket path)."""

    what: str
    flag: str
    start: str


ENGINE = Peer(
    "engine", "--target (env ENGINE_TARGET)", "python -m engine_client serve --uds {path}"
)
KV_SERVICE = Peer(
    "KV service", "--service (env ENGINE_SERVICE)", "python -m kv_service --uds {path}"
)


def unreachable(peer: Peer, target: str, timeout: float) -> Unreachable:
    """The error for `target`, with the likely cause from what is at the address."""
    if target.startswith("unix:"):
        path = target.removeprefix("unix:").removeprefix("//")
        if not os.path.exists(path):
            why = (
                f"the socket {path} does not exist. Start the {peer.what} "
                f"(`{peer.start.format(path=path)}`) or point {peer.flag} at its socket"
            )
        else:
            why = (
                f"{path} exists but nothing accepts connections on it (left by a stopped "
                f"process?). Restart the {peer.what}, or point {peer.flag} at a live one"
            )
    else:
        why = (
            f"nothing accepts connections there. Check the host and port, that the "
            f"{peer.what} listens on TCP, and {peer.flag}"
        )
    return Unreachable(f"no {peer.what} at {target} within {timeout:g}s: {why}")


async def wait_ready(channel: grpc.aio.Channel, peer: Peer, target: str, timeout: float) -> None:
    """Return once the channel is connected; Unreachable after `timeout` seconds."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except TimeoutError:
        raise unreachable(peer, target, timeout) from None
