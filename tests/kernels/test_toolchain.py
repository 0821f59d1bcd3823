"""kernels.toolchain: a child gets the CUDA tools its parent's Triton found, and a process that
cannot run ptxas says why (the path, the exit status, what it printed), not only "Cannot find
ptxas" (the KV service under compute-sanitizer, issue 37)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import triton

from kernels import toolchain


def test_a_child_gets_the_tools_its_parent_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert toolchain.child_env() == {}, "an interpreted Triton resolves no CUDA tool"
    monkeypatch.delenv("TRITON_INTERPRET")
    env = toolchain.child_env()
    ptxas = env["TRITON_PTXAS_PATH"]
    assert os.path.isabs(ptxas) and os.access(ptxas, os.X_OK)
    assert ptxas == os.path.abspath(triton.knobs.nvidia.ptxas.path)


def test_a_ptxas_that_does_not_answer_is_named_with_what_it_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "ptxas"
    broken.write_text("#!/bin/sh\necho 'injection failed: no front-end' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(broken))
    said = toolchain._attempts(triton.knobs)
    assert said[0] == f"{broken} --version exited 3: injection failed: no front-end"
    assert "release" in said[1], "the bundled ptxas is tried too, as Triton does"
