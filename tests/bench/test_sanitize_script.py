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


def _run(tmp_path: Path, **env: str) -> Path:
    """bench/sanitize.sh with the stand-in sanitizer and memcheck only; its output folder."""
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
    return out


def _churn_command(tmp_path: Path, **env: str) -> str:
    out = _run(tmp_path, SANITIZE_WARM="0", **env)
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


def test_a_warm_up_runs_the_kernel_pass_without_the_sanitizer_first(tmp_path: Path) -> None:
    # Bounded to 1 s here (the kernel pass itself takes ~24 s on CPU): what is checked is that it
    # ran as plain python, not under the tool, and before the tool's first part.
    out = _run(tmp_path, SANITIZE_WARM_S="1")
    warm = out / "sanitize_warm.log"
    assert warm.exists()
    assert "RAN " not in warm.read_text()
    assert warm.stat().st_mtime <= (out / "sanitize_memcheck.kernels.log").stat().st_mtime


def test_the_warm_up_can_be_skipped(tmp_path: Path) -> None:
    out = _run(tmp_path, SANITIZE_WARM="0")
    assert not (out / "sanitize_warm.log").exists()
    assert (out / "sanitize_memcheck.kernels.log").exists()
