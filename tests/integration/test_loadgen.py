"""docker/loadgen.sh with a stand-in `python` on PATH (no engine needed): a stream that fails
shows its reason, the client's `generate: error (...)` line, not only a failure count."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LOADGEN = Path(__file__).resolve().parents[2] / "docker" / "loadgen.sh"
FAILING_CLIENT = """#!/bin/sh
echo "generate: error (UNAVAILABLE) from the engine at unix:/x: the KV service went away" >&2
exit 1
"""


def test_a_failed_stream_shows_its_reason(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAILING_CLIENT)
    fake.chmod(0o755)
    env = os.environ | {"PATH": f"{tmp_path}:{os.environ['PATH']}", "LOADGEN_STREAMS": "2"}
    done = subprocess.run(
        ["sh", str(LOADGEN)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    reasons = [line for line in done.stdout.splitlines() if line.startswith("generate: error")]
    assert len(reasons) == 2, done.stdout
    assert "the KV service went away" in reasons[0]
    assert "2 streams, 2 failed" in done.stdout
