"""Addresses as users give them (`client/address.py`): a socket path becomes an absolute unix
target, everything gRPC already understands passes through, and the engine's default socket
prefers the per-user runtime directory."""

from __future__ import annotations

import os

from engine_client.client.address import (
    ENGINE_SOCKET,
    default_uds,
    engine_target_default,
    grpc_target,
)


def test_a_socket_path_becomes_an_absolute_unix_target(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    assert grpc_target("/run/x.sock") == "unix:/run/x.sock"
    assert grpc_target("./e.sock") == "unix:" + os.path.join(str(tmp_path), "e.sock")
    assert grpc_target("../e.sock") == "unix:" + os.path.join(str(tmp_path.parent), "e.sock")


def test_targets_grpc_understands_pass_through() -> None:
    for target in ("unix:/a.sock", "dns:host:1", "ipv4:127.0.0.1:1", "ipv6:[::1]:1", "host:50051"):
        assert grpc_target(target) == target


def test_the_engine_default_prefers_env_then_runtime_dir_then_tmp() -> None:
    assert engine_target_default({"ENGINE_TARGET": "h:1", "XDG_RUNTIME_DIR": "/run/u"}) == "h:1"
    assert engine_target_default({"XDG_RUNTIME_DIR": "/run/u"}) == f"/run/u/{ENGINE_SOCKET}"
    assert engine_target_default({"XDG_RUNTIME_DIR": ""}) == f"/tmp/{ENGINE_SOCKET}"
    assert default_uds({}, "kv.sock") == "/tmp/kv.sock"
