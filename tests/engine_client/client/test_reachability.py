"""Saying plainly why a server is not there (`client/reachability.py`): the cause read from
what is at the address, a bounded wait for a channel, and a server of the other kind found
through its health service."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from engine_client.client.reachability import (
    ENGINE,
    KV_SERVICE,
    Unreachable,
    WrongPeer,
    unreachable,
    wait_ready,
    wrong_peer,
)
from tests.grpc_harness import running_server
from transport import grpc_server


def test_the_cause_comes_from_what_is_at_the_address(tmp_path) -> None:
    missing = unreachable(KV_SERVICE, f"unix:{tmp_path}/kv.sock", 5)
    assert "does not exist" in str(missing) and "python -m kv_service --uds" in str(missing)
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file nobody listens on
    assert "nothing accepts connections on it" in str(unreachable(ENGINE, f"unix:{stale}", 5))
    tcp = unreachable(ENGINE, "localhost:1", 2.5)
    assert "Check the host and port" in str(tcp) and "within 2.5s" in str(tcp)
    assert isinstance(tcp, Unreachable) and ENGINE.flag in str(tcp)


def test_waiting_for_a_missing_socket_ends_at_the_timeout(tmp_path) -> None:
    target = f"unix:{tmp_path}/none.sock"

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            await wait_ready(channel, ENGINE, target, 0.3)

    start = time.monotonic()
    with pytest.raises(Unreachable, match="no engine at"):
        asyncio.run(run())
    assert time.monotonic() - start < 3


def test_the_other_kind_of_peer_is_named() -> None:
    async def run() -> tuple[WrongPeer | None, WrongPeer | None]:
        async with running_server("decode.v1.DecodeService") as srv:
            await grpc_server.set_health(srv.health, "decode.v1.DecodeService", True)
            at_engine = await wrong_peer(srv.channel, KV_SERVICE, srv.target)
            as_expected = await wrong_peer(srv.channel, ENGINE, srv.target)
            return at_engine, as_expected

    at_engine, as_expected = asyncio.run(run())
    assert isinstance(at_engine, WrongPeer) and "is an engine (decode.v1.DecodeService)" in str(
        at_engine
    )
    assert "not a KV service" in str(at_engine)
    assert as_expected is None  # the engine is what was asked for: nothing else to say
