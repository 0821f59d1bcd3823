"""docker/docker-compose.disagg.yml, the disaggregated stack (issue 42): it validates; the
kv-service has its NIXL agent; the prefill engine computes in its own cache with the service's
sizes and formats; the decode engine sends prompts to the prefill engine's socket; the gateway
is in front of the decode engine; the image gets a NIXL wheel; every variable the file reads
is in .env.example and every engine setting it sets is one the CLI reads. No Docker engine:
`docker-compose config` only parses."""

from __future__ import annotations

import re

import pytest

from tests.integration.test_docker import (
    DOCKER,
    compose,
    needs_compose,
    resolved,
    settings_are_read,
)

pytestmark = pytest.mark.timeout(120)

FILE = DOCKER / "docker-compose.disagg.yml"
SIZES = ("PAGE_SIZE", "NUM_PAGES", "MAX_CONTEXT", "ROW_FORMAT", "INDEX_FORMAT")


@pytest.fixture(scope="module")
def stack() -> dict:
    return resolved(FILE)


@needs_compose
def test_the_file_validates_and_builds_with_nixl(stack: dict) -> None:
    assert compose(FILE, "config", "-q").returncode == 0
    assert stack["services"]["prefill"]["build"]["args"]["NIXL_PACKAGE"] == "nixl-cu12"
    assert 'pip install --no-deps "${NIXL_PACKAGE}"' in (DOCKER / "Dockerfile").read_text()


@needs_compose
def test_roles_peers_and_sizes(stack: dict) -> None:
    svc = stack["services"]
    kvs, pre, dec = (svc[n]["environment"] for n in ("kv-service", "prefill", "decode"))
    assert kvs["KVS_NIXL"] == "1"
    assert (pre["ENGINE_ROLE"], pre["ENGINE_KV_MODE"]) == ("prefill", "baseline")
    assert (dec["ENGINE_ROLE"], dec["ENGINE_KV_MODE"]) == ("decode", "service")
    assert dec["ENGINE_PREFILL_PEER"] == f"unix://{pre['ENGINE_UDS']}"
    assert svc["gateway"]["environment"]["GATEWAY_TARGET"] == f"unix://{dec['ENGINE_UDS']}"
    for key in SIZES:  # rows are copied as bytes: the prefill cache is the service's layout
        assert pre[f"ENGINE_{key}"] == kvs[f"KVS_{key}"], key
    for name in ("kv-service", "prefill", "decode"):  # UCX may use shared memory
        assert svc[name]["ipc"] == "service:holder" and svc[name]["pid"] == "service:holder"


@needs_compose
def test_engine_settings_are_the_clis(stack: dict) -> None:
    modules = {
        "kv-service": ("kv_service",),
        "prefill": ("engine_client", "serve"),
        "decode": ("engine_client", "serve"),
        "gateway": ("engine_client", "gateway"),
    }
    settings_are_read(stack["services"], modules)


def test_env_example_lists_every_variable() -> None:
    example = (DOCKER / ".env.example").read_text()
    for var in set(re.findall(r"\$\{(HISPARSE_\w+)", FILE.read_text())):
        assert re.search(rf"^#? ?{var}=", example, re.M), f"{var} not in .env.example"
