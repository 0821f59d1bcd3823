"""`python -m engine_client demo`, as a user runs it: exit 0, stats printed, nothing left behind
(no child process, no /dev/shm segment, no temp dir)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from engine_client.procs import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_runs_and_cleans_up() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "KVS_"))}
    proc = subprocess.Popen([sys.executable, "-m", "engine_client", "demo", "--no-progress",
                             "--requests", "3", "--max-new-tokens", "16", "--device", "cpu"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=100)
    assert proc.returncode == 0, out
    assert "demo finished cleanly" in out
    assert re.search(r"service: hit rate \d+\.\d%", out) and "B moved host->device" in out
    assert len(re.findall(r"r\d: request \w+: 16 tokens, LENGTH, TTFT", out)) == 3, out
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    assert len(pids) == 2 and not any(_alive(p) for p in pids), out
    # The demo names its service instance after its own pid.
    prefix = f"hisparse-demo{proc.pid}-"
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
    workdir = re.search(r"on unix:(/tmp/hisparse-demo-[^/]+)/", out).group(1)
    assert not os.path.exists(workdir)
