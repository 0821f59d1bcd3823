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


def _fake_ptxas(tmp_path: Path, fail_first: bool) -> Path:
    """A ptxas that fails its first `--version` (fail_first) or every one."""
    tool, seen = tmp_path / "ptxas", tmp_path / "seen"
    answer = "echo 'Cuda compilation tools, release 12.9'; exit 0" if fail_first else "exit 3"
    tool.write_text(
        f"#!/bin/sh\nif [ -e {seen} ]; then {answer}; fi\n"
        f"touch {seen}\necho 'no front-end'\nexit 3\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


@pytest.mark.parametrize("fail_first", [True, False])
def test_a_failed_answer_is_asked_again_then_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_first: bool
) -> None:
    """Triton keeps a failed `--version` answer for the process's life: check() clears it and
    asks again; a ptxas that never answers is named with what it said."""
    tool = _fake_ptxas(tmp_path, fail_first)
    knob = type(triton.knobs.nvidia).__dict__["ptxas"]
    monkeypatch.setattr(knob, "default_path", str(tool))  # Triton's own ptxas: the fake
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    triton.knobs.NvidiaTool.from_path.cache_clear()
    try:
        if fail_first:
            assert toolchain.check(pause=0) == str(tool)
        else:
            with pytest.raises(toolchain.ToolchainError, match=f"{tool} --version exited 3"):
                toolchain.check(pause=0)
    finally:
        triton.knobs.NvidiaTool.from_path.cache_clear()
