"""Waiting for a gRPC server to accept connections, and saying plainly why one does not.

A call with wait_for_ready waits out its whole deadline on an address where nothing listens, and
then reports only DEADLINE_EXCEEDED. The CLIs instead wait a few seconds for the channel, then
fail with the address and the likely fix (`Unreachable`). A server that answers UNIMPLEMENTED may
be the other kind of peer (an engine's socket given for a KV service, or the reverse):
`wrong_peer` asks its health service which one it is (`WrongPeer`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract import errors


class Unreachable(errors.ServiceUnavailable):
    """Nothing accepted a connection at the address within the connect timeout."""


class WrongPeer(errors.InvalidArgument):
    """The address is served by the other kind of peer (a usage error: the wrong address)."""


@dataclass(frozen=True)
class Peer:
    """Who should listen at an address: `what` names it, `flag` is where the user sets the
    address, `start` how to start it (with {path} for a socket path)."""

    what: str
    flag: str
    start: str

    @property
    def a(self) -> str:
        """`what` with its article: "an engine", "a KV service"."""
        return ("an " if self.what[0] in "aeiou" else "a ") + self.what


ENGINE = Peer(
    "engine", "--target (env ENGINE_TARGET)", "python -m engine_client serve --uds {path}"
)
KV_SERVICE = Peer(
    "KV service", "--service (env ENGINE_SERVICE)", "python -m kv_service --uds {path}"
)
# The library's own wording: an engine adopting it has its own flags.
KV_SERVICE_TARGET = Peer(
    "KV service", "the target given to KVClient.connect", "python -m kv_service --uds {path}"
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


# gRPC service names of our two servers, as their health services know them.
SERVICE_NAMES = {"kvcache.v1.KVCacheService": KV_SERVICE, "decode.v1.DecodeService": ENGINE}


async def wrong_peer(channel: grpc.aio.Channel, expected: Peer, target: str) -> WrongPeer | None:
    """After an UNIMPLEMENTED answer: the error naming what listens at `target` instead of
    `expected`, if its health service knows one of our other servers; else None."""
    stub = health_pb2_grpc.HealthStub(channel)
    for name, peer in SERVICE_NAMES.items():
        if peer.what == expected.what:
            continue
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2.0)
        except grpc.RpcError:
            continue
        return WrongPeer(
            f"{target} is {peer.a} ({name}), not {expected.a}: point {expected.flag} at "
            f"the {expected.what}'s address"
        )
    return None
