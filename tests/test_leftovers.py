"""The session-level leftover check (tests/leftovers.py, run by conftest at the end of every
session) finds temporary files, /dev/shm files and child processes, and only this session's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import leftovers
from tests.leftovers import Session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_leftovers_of_a_session_are_named_and_its_children_killed() -> None:
    root = tempfile.mkdtemp(prefix="hsrun", dir="/tmp")
    fake = Session(root, set(os.listdir(leftovers.SHM)))
    shm_own = os.path.join(leftovers.SHM, f"{fake.marker}-x-shm")
    shm_pid = os.path.join(leftovers.SHM, f"hisparse-t-{os.getpid()}-host_kv")
    shm_other = os.path.join(leftovers.SHM, "hisparse-t-1-host_kv")  # pid 1: not ours
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.mkdir(os.path.join(root, "kvsvc-m123"))
        os.mkdir(os.path.join(root, "pytest-of-root"))  # pytest's own: not a leftover
        for path in (shm_own, shm_pid, shm_other):
            open(path, "w").close()
        left = fake.leftovers()
        assert f"temp: {root}/kvsvc-m123" in left
        assert f"/dev/shm: {os.path.basename(shm_own)}" in left
        assert f"/dev/shm: {os.path.basename(shm_pid)}" in left
        assert not [x for x in left if "pytest-of" in x or "hisparse-t-1-" in x], left
        assert any(x.startswith(f"process {child.pid}: ") for x in left), left
        assert child.wait(10) != 0  # killed
    finally:
        child.kill()
        child.wait()
        for path in (shm_own, shm_pid, shm_other):
            os.unlink(path)
        shutil.rmtree(root)


def test_the_session_writes_its_temporary_files_under_its_own_root() -> None:
    assert os.path.basename(tempfile.gettempdir()).startswith("hsrun")
    assert os.environ["TMPDIR"] == tempfile.gettempdir()


def test_a_kept_root_is_named_and_a_clean_one_removed() -> None:
    kept = Session(tempfile.mkdtemp(prefix="hsrun", dir="/tmp"))
    gone = Session(tempfile.mkdtemp(prefix="hsrun", dir="/tmp"))
    try:
        for s in (kept, gone):
            open(os.path.join(s.root, "log"), "w").close()
        assert kept.end(keep=True) == kept.root and os.path.isdir(kept.root)
        assert gone.end(keep=False) is None and not os.path.exists(gone.root)
    finally:
        shutil.rmtree(kept.root, ignore_errors=True)
        shutil.rmtree(gone.root, ignore_errors=True)


LEAKY = """
import os, subprocess, sys, tempfile

def test_leaves_a_file():
    open(os.path.join(tempfile.gettempdir(), "left-by-a-worker"), "w").close()

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
"""


def test_leftovers_of_xdist_workers_fail_the_run_and_are_named(tmp_path) -> None:
    """Two workers, each a session with its own check: the controller reports what they left
    and the roots they kept, and the run fails although every test passed."""
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    # xdist is the one plugin this run needs: the others installed (hypothesis, benchmark...)
    # cost each of its three processes seconds of imports and check nothing here.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    args = ["-q", "-n", "2", "-p", "xdist", "-p", "no:cacheprovider", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    kept = re.findall(r"kept for a look \(rm -r when done\): (\S+)", run.stdout)
    try:
        assert run.returncode == 1 and "2 passed" in run.stdout, run.stdout + run.stderr
        assert re.search(r"temp: /tmp/hsrun\w+/left-by-a-worker", run.stdout), run.stdout
        assert re.search(r"process \d+: \S+ -c import time", run.stdout), run.stdout
        assert kept and all(os.path.isdir(k) for k in kept), run.stdout
    finally:
        for root in kept:
            shutil.rmtree(root, ignore_errors=True)


def test_a_cuda_driver_file_of_a_started_process_is_named_and_removed() -> None:
    """contract.cuda_shm: the supervisor removes a reaped child's driver file; one still there
    at the end fails the run, and goes, so that the next run starts clean. Another process's
    (pid 1 here: not started by this session) is left alone."""
    root = tempfile.mkdtemp(prefix="hsrun", dir="/tmp")
    fake = Session(root, set(os.listdir(leftovers.SHM)))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = os.path.join(leftovers.SHM, f"cuda.shm.0.{child.pid:x}.1")
    other = os.path.join(leftovers.SHM, "cuda.shm.0.1.1")
    leftovers.SPAWNED.add(child.pid)
    try:
        for path in (mine, other):
            open(path, "w").close()
        left = fake.leftovers()
        assert [x for x in left if "cuda.shm" in x] == [
            f"/dev/shm: cuda.shm.0.{child.pid:x}.1"
            " (the CUDA driver's, of a process this run started)"
        ]
        assert not os.path.exists(mine) and os.path.exists(other)
    finally:
        leftovers.SPAWNED.discard(child.pid)
        for path in (mine, other):
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(root)
