"""Lint and type checks as part of the test suite, so CI runs them through the README's one test
command. Both read their configuration from pyproject.toml ([tool.ruff], [tool.mypy]); the tools
come with the `test` extra."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]' brings it)")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    )
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_ruff_check_passes() -> None:
    done = run_tool("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, f"ruff check failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.timeout(300)
def test_ruff_format_is_clean() -> None:
    done = run_tool("ruff", "format", "--check", "--no-cache", ".")
    assert done.returncode == 0, f"ruff format would change files:\n{done.stdout}\n{done.stderr}"


def test_mypy_passes_on_the_whole_package() -> None:
    done = run_tool("mypy")
    assert done.returncode == 0, f"mypy failed:\n{done.stdout}\n{done.stderr}"
    assert "Success" in done.stdout
