"""docker/restart-check.sh: kv-service restarted 5 times with streams in flight, the engine
keeping its process and serving new requests.

- Against stand-in `docker-compose` and `docker` commands (always): the script's sequence and
  verdicts, passing when the engine keeps its pid and failing, naming the round, when it does not
  or when it stops re-attaching.
- For real where a Docker daemon answers and the image is there (slow: ~6 min on CPU); skipped
  with the reason elsewhere. HISPARSE_RESTART_COMPOSE_FILES (space-separated) adds compose files,
  e.g. an override that supplies a locally made image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[2] / "docker"
SCRIPT = DOCKER / "restart-check.sh"
CPU_FILE = DOCKER / "docker-compose.cpu.yml"

FAKE_COMPOSE = r"""#!/bin/sh
# Stand-in docker-compose: records calls, counts restarts, answers like the stack would.
state=$FAKE_STATE
echo "$*" >>"$state/calls"
while [ $# -gt 0 ]; do case "$1" in -p|-f) shift 2 ;; *) break ;; esac; done
case "$1" in
    up|down) exit 0 ;;
    ps) echo cid-engine ;;
    restart) echo x >>"$state/restarts" ;;
    logs)
        n=$(cat "$state/restarts" 2>/dev/null | wc -l)
        [ "${FAKE_STOP_REATTACH:-0}" = 1 ] && n=0
        i=0; while [ "$i" -lt "$n" ]; do echo "re-attached to unix:///x"; i=$((i + 1)); done ;;
    exec)
        case "$*" in
            *hisparse-healthcheck*) exit 0 ;;
            *generate*)
                echo "request r$$" >&2
                echo "request r$$: 16 tokens, LENGTH, TTFT 5.0 ms" ;;
        esac ;;
esac
"""
FAKE_DOCKER = r"""#!/bin/sh
# Stand-in docker: `inspect` gives the engine's pid, start time and restart count.
n=$(cat "$FAKE_STATE/restarts" 2>/dev/null | wc -l)
if [ "${FAKE_ENGINE_DIES:-0}" = 1 ] && [ "$n" -ge 1 ]; then
    echo "222 2026-01-01T00:01:00Z 1"
else
    echo "111 2026-01-01T00:00:00Z 0"
fi
"""


def _run_fake(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (("docker-compose", FAKE_COMPOSE), ("docker", FAKE_DOCKER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    full = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_STATE=str(state),
        RESTART_PROJECT="fake",
        **env,
    )
    return subprocess.run(
        ["sh", str(SCRIPT), "-f", str(CPU_FILE)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_script_restarts_five_times_and_checks_the_engine(tmp_path: Path) -> None:
    out = _run_fake(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith("restart-check: round")]
    assert len(lines) == 5 and all("engine kept (pid 111)" in x for x in lines), out.stdout
    assert "5 kv-service restarts, engine kept its process" in out.stdout
    calls = (tmp_path / "state" / "calls").read_text().splitlines()
    assert calls[0] == f"-p fake -f {CPU_FILE} up -d engine"
    assert sum(c.endswith("restart kv-service") for c in calls) == 5
    # Two streams in flight per restart, and one new request after it.
    assert sum("generate" in c and "--max-new-tokens 400" in c for c in calls) == 10
    assert sum("generate" in c and "--max-new-tokens 16" in c for c in calls) == 5
    assert calls[-1] == "-p fake -f " + str(CPU_FILE) + " down -v --remove-orphans"


def test_the_script_fails_when_the_engine_is_restarted(tmp_path: Path) -> None:
    out = _run_fake(tmp_path, FAKE_ENGINE_DIES="1")
    assert out.returncode == 1
    assert "FAIL: round 1: engine pid/start/restarts 111 " in out.stderr, out.stderr


def test_the_script_fails_when_the_engine_does_not_reattach(tmp_path: Path) -> None:
    out = _run_fake(tmp_path, FAKE_STOP_REATTACH="1")
    assert out.returncode == 1 and "FAIL: round 1: 0 re-attaches" in out.stderr, out.stderr


def _docker_unusable() -> str | None:
    """Why the real run cannot happen here, or None."""
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "docker or docker-compose is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"no Docker daemon answers: {last}"
    image = os.environ.get("HISPARSE_IMAGE", "hisparse-kv:latest")
    if os.environ.get("HISPARSE_RESTART_COMPOSE_FILES") is None:
        found = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
        if found.returncode != 0:
            return f"image {image} not built (docker-compose -f {CPU_FILE} build)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_restart_check_against_real_docker() -> None:
    why = _docker_unusable()
    if why is not None:
        pytest.skip(why)
    files = ["-f", str(CPU_FILE)]
    for extra in os.environ.get("HISPARSE_RESTART_COMPOSE_FILES", "").split():
        files += ["-f", extra]
    out = subprocess.run(["sh", str(SCRIPT), *files], capture_output=True, text=True, timeout=2300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "5 kv-service restarts, engine kept its process" in out.stdout
