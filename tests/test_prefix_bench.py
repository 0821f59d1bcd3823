"""`python bench/prefix.py --smoke` (its multi-turn part, small: the whole smoke takes ~1 min)
on CPU: real processes, a JSON with sane numbers, reuse that prefills less, nothing left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_client.serve.procs import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_prefix_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "KVS_"))}
    argv = ["--smoke", "--parts", "multiturn", "--conversations", "2", "--turns", "2"]
    proc = subprocess.run(
        [sys.executable, "bench/prefix.py", *argv, "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    assert data["leftover_segments"] == []
    plain, reuse = data["multiturn"]
    assert (plain["reuse"], reuse["reuse"]) == (False, True)
    # Turn 2 repeats turn 1 (8 prompt + 3 stored answer tokens): one full page of 8 is reused.
    assert plain["turns"][1]["prefilled_mean"] == 20 and reuse["turns"][1]["prefilled_mean"] == 12
    assert reuse["kv"]["prefix_hit_tokens_total"] == 2 * 8
    assert all(t["ttft_p50_s"] > 0 for m in (plain, reuse) for t in m["turns"])
    assert "multiturn reuse=True" in proc.stdout
