"""The compose deployment in docker/: both files validated by docker-compose, the resolved
configuration checked for what CUDA IPC and the host tier need, and the entry points run with
--help. The image's scripts themselves run in tests/integration/test_docker_script.py.

No Docker engine is needed: `docker-compose config` only parses, merges and interpolates.
Tests that run docker-compose skip, naming why, where it is not installed (a fresh machine
running the README's test command); `.ci/run` installs it and sets HISPARSE_REQUIRE_COMPOSE=1, so
there a missing docker-compose fails instead of skipping.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from contract.layout import KVLayout
from contract.tensors import tensor_specs
from engine_client.model.preset import PRESETS
from proto.decode.v1 import decode_pb2
from proto.kvcache.v1 import kvcache_pb2

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
GPU_FILE = DOCKER / "docker-compose.yml"
CPU_FILE = DOCKER / "docker-compose.cpu.yml"
FAKE_UUID = "GPU-00000000-1111-2222-3333-444444444444"
# Variables a developer's shell may set that would change what the files resolve to.
ENV_PREFIXES = ("HISPARSE_", "KVS_", "ENGINE_", "COMPOSE_", "LOADGEN_")
MIB = 1 << 20
UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
LAYOUT_ENV = {
    f.upper(): f
    for f in (
        "num_layers",
        "max_requests",
        "hot_slots",
        "window",
        "topk",
        "page_size",
        "num_pages",
        "max_context",
    )
}


COMPOSE_MISSING = (
    "docker-compose is not installed, so docker/*.yml cannot be validated "
    "(apt-get install -y docker-compose; CI installs it)"
)
# CI must not pass by skipping: there a missing docker-compose is a failure.
REQUIRE_COMPOSE = os.environ.get("HISPARSE_REQUIRE_COMPOSE") == "1"
needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None and not REQUIRE_COMPOSE, reason=COMPOSE_MISSING
)


def compose_exe() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail(COMPOSE_MISSING + " and HISPARSE_REQUIRE_COMPOSE=1")
    return exe


def compose(file: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`docker-compose -f FILE <args>` in a clean environment: no HISPARSE_*/KVS_*/ENGINE_*
    from the caller's shell and an empty env file instead of a developer's docker/.env."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES)}
    with tempfile.NamedTemporaryFile(suffix=".env") as empty:
        return subprocess.run(
            [compose_exe(), "--env-file", empty.name, "-f", str(file), *args],
            env=dict(clean, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )


def yaml_to_data(text: str) -> dict:
    """docker-compose prints YAML. PyYAML is not a test dependency, but docker-compose 1.x is a
    Python program that always has it, so its own interpreter does the parsing when we cannot."""
    try:
        import yaml

        return yaml.safe_load(text)
    except ImportError:
        pass
    with open(compose_exe(), "rb") as f:
        shebang = f.readline().decode(errors="replace")
    if not shebang.startswith("#!"):
        pytest.fail("cannot parse docker-compose output: install pyyaml")
    interpreter = shlex.split(shebang[2:])
    code = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
    out = subprocess.run(
        interpreter + ["-c", code],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def resolved(file: Path, **env: str) -> dict:
    out = compose(file, "config", **env)
    assert out.returncode == 0, out.stderr
    return yaml_to_data(out.stdout)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return resolved(GPU_FILE, HISPARSE_GPU_UUID=FAKE_UUID)["services"]


@pytest.fixture(scope="module")
def cpu() -> dict:
    return resolved(CPU_FILE)["services"]


# Ids avoid the word "gpu": conftest skips every test whose keywords include it.
@pytest.fixture(scope="module", params=["gpu", "cpu"], ids=["main-file", "cpu-file"])
def stack(request: pytest.FixtureRequest) -> dict:
    return request.getfixturevalue(request.param)


@needs_compose
def test_compose_files_validate() -> None:
    for file, env in ((GPU_FILE, {"HISPARSE_GPU_UUID": FAKE_UUID}), (CPU_FILE, {})):
        out = compose(file, "config", "-q", **env)
        assert out.returncode == 0, f"{file}: {out.stderr}"


@needs_compose
def test_gpu_uuid_is_required_and_comes_from_env(gpu: dict) -> None:
    out = compose(GPU_FILE, "config", "-q")
    assert out.returncode != 0 and "HISPARSE_GPU_UUID" in out.stderr
    for name in ("kv-service", "engine"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [FAKE_UUID], "capabilities": ["gpu"]}]
    assert "deploy" not in gpu["loadgen"]


@needs_compose
def test_cpu_variant_is_the_same_stack_without_gpu(gpu: dict, cpu: dict) -> None:
    """Two files, one stack: only device, model size, layout, shm and load may differ."""
    assert all("deploy" not in svc for svc in cpu.values())
    assert cpu["kv-service"]["environment"]["KVS_DEVICE"] == "cpu"
    assert cpu["engine"]["environment"]["ENGINE_DEVICE"] == "cpu"
    assert cpu["engine"]["environment"]["ENGINE_PRESET"] == "tiny"
    may_differ = {"deploy", "shm_size", "environment"}
    env_may_differ = {
        "KVS_DEVICE",
        "ENGINE_DEVICE",
        "ENGINE_PRESET",
        "ENGINE_MAX_BATCH",
        *(f"{p}_{k}" for k in LAYOUT_ENV for p in ("KVS", "ENGINE")),
    }
    assert gpu.keys() == cpu.keys()
    for name in gpu:
        g, c = gpu[name], cpu[name]
        for key in (g.keys() | c.keys()) - may_differ:
            assert g.get(key) == c.get(key), f"{name}.{key} differs between the files"
        genv, cenv = g.get("environment", {}), c.get("environment", {})
        assert genv.keys() == cenv.keys(), name
        for key in genv.keys() - env_may_differ:
            if not key.startswith("LOADGEN_"):
                assert genv[key] == cenv[key], f"{name}.environment.{key} differs"


@needs_compose
def test_engine_sizes_follow_the_service_layout(stack: dict) -> None:
    """The engine's local KV sizes (baseline/embedded modes) are the service's; its layers and
    top-k are not set by hand: in service modes the engine adopts the service's at attach, and
    the default layout fits the preset's for the local modes."""
    kvs, eng = stack["kv-service"]["environment"], stack["engine"]["environment"]
    for key in LAYOUT_ENV:
        if f"ENGINE_{key}" in eng:
            assert eng[f"ENGINE_{key}"] == kvs[f"KVS_{key}"], key
    assert "ENGINE_NUM_LAYERS" not in eng and "ENGINE_TOPK" not in eng
    model = PRESETS[eng["ENGINE_PRESET"]]
    assert (int(kvs["KVS_NUM_LAYERS"]), int(kvs["KVS_TOPK"])) == (model.num_layers, model.topk)


@needs_compose
def test_namespaces_and_volumes(stack: dict) -> None:
    """Both join the holder's IPC and PID namespaces (CUDA IPC needs both shared, the engine
    checks its service's pid), never each other's: a restart of either leaves the other."""
    holder, svc, eng = stack["holder"], stack["kv-service"], stack["engine"]
    assert holder["ipc"] == "shareable" and "pid" not in holder
    assert holder["command"] == ["sleep", "infinity"] and holder["restart"] == "unless-stopped"
    assert holder["network_mode"] == "none" and "volumes" not in holder
    for joined in (svc, eng):
        assert joined["ipc"] == "service:holder" and joined["pid"] == "service:holder"
    mounts = {
        name: dict(reversed(v.split(":")[:2]) for v in stack[name]["volumes"])
        for name in ("kv-service", "engine")
    }
    uds_dir = os.path.dirname(svc["environment"]["KVS_UDS"])
    assert mounts["kv-service"][uds_dir] == mounts["engine"][uds_dir]
    assert eng["environment"]["ENGINE_SERVICE"] == "unix://" + svc["environment"]["KVS_UDS"]
    assert os.path.dirname(eng["environment"]["ENGINE_UDS"]) == uds_dir
    cache = re.search(r"TRITON_CACHE_DIR=(\S+)", (DOCKER / "Dockerfile").read_text()).group(1)
    assert mounts["kv-service"][cache] == mounts["engine"][cache]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([bkmg]?)b?", str(text).strip().lower())
    assert m, f"unparsable size {text!r}"
    return int(m.group(1)) * UNITS[m.group(2)]


def shm_needed(env: dict, device: str) -> int:
    """docs/DEPLOY.md's formula: the bytes in /dev/shm plus max(10%, 256 MiB) headroom."""
    layout = KVLayout(
        **{f: int(env[f"KVS_{k}"]) for k, f in LAYOUT_ENV.items()},
        row_format=env["KVS_ROW_FORMAT"],
        index_format=env["KVS_INDEX_FORMAT"],
    )
    if device == "cuda":
        data = layout.host_tier_bytes
    else:
        # CPU mode: every tensor is a /dev/shm file.
        data = sum(
            math.prod(shape) * dtype.itemsize for shape, dtype in tensor_specs(layout).values()
        )
    return data + max(data // 10, 256 * MIB)


@needs_compose
def test_shm_size_fits_the_configured_layout(stack: dict) -> None:
    env = stack["kv-service"]["environment"]
    assert parse_size(stack["holder"]["shm_size"]) >= shm_needed(env, env["KVS_DEVICE"])
    # Both share the holder's /dev/shm; a size of their own would be ignored.
    assert "shm_size" not in stack["kv-service"] and "shm_size" not in stack["engine"]


@needs_compose
def test_shm_size_and_layout_come_from_env() -> None:
    data = resolved(
        GPU_FILE, HISPARSE_GPU_UUID=FAKE_UUID, HISPARSE_SHM_SIZE="80g", HISPARSE_NUM_PAGES="16384"
    )["services"]
    assert parse_size(data["holder"]["shm_size"]) == 80 << 30
    assert data["kv-service"]["environment"]["KVS_NUM_PAGES"] == "16384"


@needs_compose
def test_healthchecks_start_order_and_restarts(stack: dict) -> None:
    # The names the servers register their health under: their protos' service names.
    expect = {
        "kv-service": (
            "/run/hisparse/kv.sock",
            kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"].full_name,
        ),
        "engine": (
            "/run/hisparse/engine.sock",
            decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
        ),
    }
    for name, (sock, service) in expect.items():
        test = stack[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "hisparse-healthcheck"], test
        assert f"unix://{sock}" in test and test[test.index("--service") + 1] == service
    assert stack["kv-service"]["depends_on"] == {"holder": {"condition": "service_started"}}
    assert stack["engine"]["depends_on"] == {
        "holder": {"condition": "service_started"},
        "kv-service": {"condition": "service_healthy"},
    }
    assert stack["holder"]["healthcheck"] == {"test": ["NONE"]}
    assert stack["loadgen"]["depends_on"] == {"engine": {"condition": "service_healthy"}}
    assert stack["loadgen"]["healthcheck"] == {"test": ["NONE"]}
    assert stack["kv-service"]["restart"] == "unless-stopped"
    assert stack["engine"]["restart"] == "unless-stopped"
    assert stack["loadgen"]["restart"] == "no"
    gateway = stack["gateway"]
    assert gateway["depends_on"] == {"engine": {"condition": "service_healthy"}}
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["restart"] == "unless-stopped"
    assert (
        gateway["environment"]["GATEWAY_TARGET"]
        == "unix://" + (stack["engine"]["environment"]["ENGINE_UDS"])
    )


def test_dockerfile_requirements() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"ARG BASE_IMAGE=nvidia/cuda:[\d.]+-runtime-", text)
    assert re.search(r"^USER (?!root\b)\w+", text, re.M)
    assert re.search(r"apt-get install[^\n]*(\n[^\n]*)*?\bgcc\b", text)
    assert re.search(r"^HEALTHCHECK .*\n?.*hisparse-healthcheck", text, re.M)
    assert "COPY docker/healthcheck.py /usr/local/bin/hisparse-healthcheck" in text
    assert re.search(r"pip install .*\btorch==", text)


@functools.lru_cache(maxsize=None)
def cli_help(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", *args, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, f"{args} --help: {out.stderr}"
    return out.stdout


@needs_compose
def test_entry_points_match_the_clis(stack: dict) -> None:
    assert cli_help("kv_service") and cli_help("engine_client")
    assert stack["kv-service"]["command"] == ["python", "-m", "kv_service"]
    assert stack["engine"]["command"] == ["python", "-m", "engine_client", "serve"]
    assert stack["loadgen"]["command"] == ["hisparse-loadgen"]
    assert "python -m engine_client generate" in (DOCKER / "loadgen.sh").read_text()
    modules = {
        "kv-service": ("kv_service",),
        "engine": ("engine_client", "serve"),
        "loadgen": ("engine_client", "generate"),
        "gateway": ("engine_client", "gateway"),
    }
    settings_are_read(stack, modules)


def settings_are_read(services: dict, modules: dict[str, tuple[str, ...]]) -> None:
    """Every KVS_* / ENGINE_* / GATEWAY_* variable a service sets is one its CLI reads."""
    for name, module in modules.items():
        text = cli_help(*module)
        for var in services[name]["environment"]:
            if var.startswith(("KVS_", "ENGINE_", "GATEWAY_")):
                assert var in text, f"{name} sets {var}, which `{' '.join(module)}` does not read"


def test_env_example_lists_every_variable() -> None:
    example = (DOCKER / ".env.example").read_text()
    for f in (GPU_FILE, CPU_FILE):
        for var in set(re.findall(r"\$\{(HISPARSE_\w+)", f.read_text())):
            assert re.search(rf"^#? ?{var}=", example, re.M), (
                f"{var} of {f.name} not in .env.example"
            )
