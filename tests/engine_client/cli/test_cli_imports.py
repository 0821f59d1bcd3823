"""`python -m engine_client --help` (and each command's --help) imports neither torch, nor
Triton, nor gRPC: they take seconds, and the help is read from the config dataclasses alone
(kernels.formats and the model presets are torch-free). Checked by what the interpreter
imports (-X importtime), not by a timing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from engine_client.serve.procs import REPO_ROOT

HEAVY = ("torch", "triton", "grpc")


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["demo"]])
def test_help_imports_nothing_heavy(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "engine_client", *command, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
    imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", done.stderr, re.M))
    assert "engine_client.cli.main" in imported, "the parser lost -X importtime's output"
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert heavy == [], heavy
