"""The scripts of the docker image, run for real: docker/healthcheck.py against a running service
and a stand-in health server, docker/loadgen.sh against a stand-in `python`.

Unlike tests/integration/test_docker.py these need no docker-compose.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.service_harness import SERVICE, ServiceProcess, short_tmpdir

pytestmark = pytest.mark.timeout(120)

DOCKER = Path(__file__).resolve().parents[2] / "docker"
HEALTHCHECK = DOCKER / "healthcheck.py"


def test_loadgen_script(tmp_path: Path) -> None:
    """docker/loadgen.sh against a stand-in `python` that prints what `generate` prints."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 5 6 7\n"
        "echo 'request r1: 3 tokens, LENGTH, TTFT 50.0 ms, ITL mean 10.0 ms, p50 9.0 ms'\n"
        "exit ${FAKE_RC:-0}\n"
    )
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", LOADGEN_STREAMS="3")
    out = subprocess.run(
        ["sh", str(DOCKER / "loadgen.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(
        r"^loadgen: 3 streams, 0 failed, 9 tokens in [\d.]+ s: [\d.]+ tok/s$", out.stdout, re.M
    ), out.stdout
    out = subprocess.run(
        ["sh", str(DOCKER / "loadgen.sh")],
        env=dict(env, FAKE_RC="1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0 and "3 failed" in out.stdout, out.stdout


def run_healthcheck(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSE_HEALTH_")}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(clean, **env),
    )


@pytest.fixture(scope="module")
def service():
    workdir = short_tmpdir("hc")
    svc = ServiceProcess(workdir, f"hc{os.getpid()}").start()
    try:
        yield svc.wait_serving()
        assert svc.stop() == 0, svc.log()
    finally:
        svc.kill()
        shutil.rmtree(workdir)


def test_healthcheck_against_running_service(service: ServiceProcess) -> None:
    for name in (SERVICE, ""):
        out = run_healthcheck(f"unix://{service.uds}", "--service", name)
        assert out.returncode == 0, out.stderr
        assert "SERVING" in out.stdout
    # As the image's HEALTHCHECK runs it: everything from the environment.
    out = run_healthcheck(
        "--quiet", HISPARSE_HEALTH_ADDRESS=f"unix://{service.uds}", HISPARSE_HEALTH_SERVICE=SERVICE
    )
    assert out.returncode == 0 and out.stdout == "", out.stderr
    assert run_healthcheck(service.uds, "--service", "no.such.Service").returncode == 1


def test_healthcheck_help_not_serving_and_nothing_listening() -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    workdir = short_tmpdir("hc")
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.add_insecure_port(f"unix://{workdir}/up.sock")
    server.start()
    try:
        out = run_healthcheck("--help")
        assert out.returncode == 0 and "SERVING" in out.stdout
        out = run_healthcheck(f"unix://{workdir}/up.sock", "--service", SERVICE)
        assert out.returncode == 1 and "NOT_SERVING" in out.stderr
        out = run_healthcheck(f"unix://{workdir}/none.sock", "--timeout", "1")
        assert out.returncode == 2, out.stderr
    finally:
        server.stop(None)
        shutil.rmtree(workdir)
