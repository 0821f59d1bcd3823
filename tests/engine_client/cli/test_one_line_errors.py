"""Bad input a user meets gets one line: the cause, the value, the limit and the flag or fix,
with no traceback; exit status 2 for usage errors, 1 for runtime ones (issue 24).

- `generate` flags out of the proto's range (`--seed -1`, `--ids 2147483648`, `--stop
  2147483648`) and text given as ids (`--ids "hello world"`: text goes in --text);
- argparse errors are one line too, for every command;
- `generate` pointed at a KV service's socket says it is a KV service, not an engine; a KVClient
  pointed at an engine says the reverse;
- the client library takes a plain socket path, as every CLI does;
- a prompt + max_new_tokens over the per-request limit names the flag that sets it.
(`python -m kv_service` without room in /dev/shm: tests/integration/test_service_lifecycle.py.)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engine_client.cli.main import main
from engine_client.client import reachability
from engine_client.client.kv_client import KVClient
from engine_client.client.status import code_of
from engine_client.serve.procs import REPO_ROOT
from engine_client.serve.servicer import DecodeServicer
from proto.decode.v1 import decode_pb2 as dpb
from tests.process_harness import LAYOUT, start_service, workdir

pytestmark = [pytest.mark.timeout(120)]


def one_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seed", "-1"], ["--seed -1", "[0, 2^64)"]),
        (["--ids", "2147483648"], ["--ids", "2147483648", "[0, 2^31)"]),
        (["--stop", "2147483648"], ["--stop", "2147483648", "[0, 2^31)"]),
        (["--ids", "1,-3"], ["--ids", "-3", "[0, 2^31)"]),
        (["--ids", "hello world"], ["'hello world'", "token ids", "--text"]),
        (["--max-new-tokens", "x"], ["--max-new-tokens", "'x'"]),
    ],
)
def test_generate_usage_errors_are_one_line(argv, words, capsys) -> None:
    args = ["generate", "--target", "/nonexistent/engine.sock", *argv]
    try:
        status = main(args, env={})
    except SystemExit as e:  # argparse's own errors
        status = e.code
    assert status == 2
    line = one_line(capsys.readouterr().err)
    assert all(w in line for w in words), line


def test_service_usage_errors_are_one_line() -> None:
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": os.environ.get("PATH", "")}
    out = subprocess.run(
        [sys.executable, "-m", "kv_service", "--num-pages", "many"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--num-pages" in one_line(out.stderr) and "'many'" in out.stderr


def test_max_new_tokens_over_the_context_names_the_flag() -> None:
    engine = SimpleNamespace(
        compute=SimpleNamespace(
            model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=100)),
            layout=SimpleNamespace(max_context=256),
            synthetic_context=0,
        ),
        scheduler=SimpleNamespace(reserve_extra=0),
    )
    request = dpb.GenerateRequest(token_ids=dpb.TokenIds(ids=[1, 2, 3]), max_new_tokens=300)
    for uses_service, flag in ((True, "KVS_MAX_CONTEXT"), (False, "ENGINE_MAX_CONTEXT")):
        servicer = DecodeServicer(uses_service)
        servicer.engine = engine  # type: ignore[assignment]
        why = servicer._check(request, [1, 2, 3])
        assert why is not None and "--max-context" in why and flag in why, why
        assert "303" in why and "256" in why and "at most 253 new tokens" in why, why
    # Speculative steps (D = 2) reserve 2 more tokens, named in the answer.
    engine.scheduler.reserve_extra = 2
    why = servicer._check(request, [1, 2, 3])
    assert why is not None and "+ 2 speculative rows = 305" in why, why
    assert "at most 251 new tokens" in why, why


@pytest.fixture(scope="module")
def svc():
    with workdir("hs1") as path:
        service = start_service(path)
        yield service
        assert service.stop() == 0, service.log()


@pytest.mark.slow
def test_the_client_library_takes_a_plain_socket_path(svc) -> None:
    async def run() -> None:
        c = await KVClient.connect(svc.uds, engine_name="t", attach_timeout=5, rpc_timeout=3)
        try:
            assert c.target == f"unix:{svc.uds}" and c.layout == LAYOUT
        finally:
            await c.close(detach=True)

    asyncio.run(asyncio.wait_for(run(), 20))  # the old client waited 10 s, then failed


@pytest.mark.slow
def test_generate_at_a_kv_service_says_so(svc) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "GENERATE_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "engine_client", "generate", "--target", svc.uds],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    line = one_line(out.stderr)
    assert "is a KV service (kvcache.v1.KVCacheService), not an engine" in line, line
    assert "--target" in line and "UNIMPLEMENTED" not in line, line


def test_a_kv_client_at_an_engine_says_so(tmp_path) -> None:
    """An in-process server that, like an engine, knows only decode.v1.DecodeService."""

    async def run() -> None:
        server = grpc.aio.server()
        health = health_aio.HealthServicer()
        await health.set("decode.v1.DecodeService", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        sock = str(tmp_path / "engine.sock")
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        try:
            with pytest.raises(reachability.WrongPeer) as err:
                await KVClient.connect(sock, engine_name="t", attach_timeout=5)
            assert "is an engine (decode.v1.DecodeService), not a KV service" in str(err.value)
            assert code_of(err.value) is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop(0)

    asyncio.run(run())
