"""bench/sanitize.sh's churn part runs the test files SANITIZE_TESTS names (default the plain
overlap churn), checked on CPU with a stand-in compute-sanitizer that logs its command line
instead of running it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE = """#!/usr/bin/env bash
echo "RAN $*"
echo "========= ERROR SUMMARY: 0 errors"
"""


def _churn_command(tmp_path: Path, **env: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    # The caller's sanitizer settings stay out of it.
    mine = {k: v for k, v in os.environ.items() if not k.startswith(("SANITIZE_", "MEMCHECK_"))}
    run_env = {
        **mine,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(out),
        "SANITIZE_TOOLS": "memcheck",
        **env,
    }
    subprocess.run(
        ["bash", "bench/sanitize.sh"], cwd=ROOT, env=run_env, capture_output=True, timeout=120
    )
    lines = (out / "sanitize_memcheck.churn.log").read_text().splitlines()
    return next(line for line in lines if line.startswith("RAN "))


@pytest.mark.parametrize(
    "tests",
    [None, "tests/integration/test_shared_churn.py"],
    ids=["default", "shared"],
)
def test_the_churn_part_runs_the_named_tests(tmp_path: Path, tests: str | None) -> None:
    env = {"SANITIZE_TESTS": tests} if tests else {}
    command = _churn_command(tmp_path, **env).split()
    assert command[command.index("--timeout") + 2] == (
        tests or "tests/integration/test_engine_stress.py"
    )
    assert command[-2:] == ["-k", "gpu"] and "-m" in command
