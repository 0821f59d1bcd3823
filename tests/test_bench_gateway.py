"""`python bench/gateway.py --smoke` on CPU: service, engine and gateway processes, streams
through gRPC and through HTTP in the same run, a JSON with both routes' numbers, nothing left
behind. (Timings on CPU mean nothing; the GPU numbers go to docs/BENCHMARKS.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_client.serve.procs import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_gateway_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "KVS_"))}
    before = {n for n in os.listdir("/dev/shm") if n.startswith("hisparse-gwbench-")}
    proc = subprocess.run(
        [sys.executable, "bench/gateway.py", "--smoke", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    for route in ("grpc", "http"):
        (phase,) = result["phases"][route]
        assert phase["streams"] == 2 and phase["tokens"] == 16, phase
        assert phase["text_events"] > 0 and phase["tok_per_s"] > 0, phase
    assert result["compare"]["http_over_grpc_tok_per_s"] > 0
    after = {n for n in os.listdir("/dev/shm") if n.startswith("hisparse-gwbench-")}
    assert after <= before
