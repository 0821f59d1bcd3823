"""`python -m engine_client demo`, as a user runs it: exit 0, each generation's text shown as it
streams, short stats, nothing left behind (no child process, no /dev/shm segment, no temp dir);
and the same cleanup when a signal (SIGTERM, SIGHUP, SIGINT) stops it mid-stream."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys

import pytest

from engine_client.serve.procs import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    """Running, or a zombie nobody reaped yet (a stopped child is reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _demo(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "KVS_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "engine_client", "demo", "--no-progress", "--device", "cpu", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _until_streaming(proc: subprocess.Popen, start: str = "streaming ") -> str:
    """The demo's output up to the line that starts with `start` (by default the one that says
    the generations stream)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(start):
            break
    return "".join(seen)


def test_demo_runs_and_cleans_up() -> None:
    proc = _demo("--requests", "3", "--max-new-tokens", "16")
    out, _ = proc.communicate(timeout=100)
    assert proc.returncode == 0, out
    assert "demo finished cleanly" in out
    assert re.search(r"service: hit rate \d+\.\d%", out) and "B moved host->device" in out
    stats = re.findall(r"^  \[(\d)\] 16 tokens \((\d+) chars\), LENGTH, TTFT", out, re.M)
    assert [k for k, _ in stats] == ["1", "2", "3"], out
    # Each generation's text, as it streamed: its lines ("[k] text") hold every character the
    # engine sent it (the stats count them).
    streamed = {k: "" for k, _ in stats}
    for k, text in re.findall(r"^\[(\d)\] (.*)$", out, re.M):
        streamed[k] += text
    assert all(streamed[k] and len(streamed[k]) == int(n) for k, n in stats), (streamed, out)
    # A streamed text line: a chat, its reply printed piece by piece, then its summary.
    reply = (
        r"chat> .+\nreply \(random weights, so gibberish\)> .+?\n  16 tokens \(\d+ chars\), LENGTH"
    )
    assert re.search(reply, out, re.S), out
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    assert len(pids) == 2 and not any(_alive(p) for p in pids), out
    # The demo names its service instance after its own pid.
    prefix = f"hisparse-demo{proc.pid}-"
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
    workdir = re.search(r"on unix:(/tmp/hisparse-demo-[^/]+)/", out).group(1)
    assert not os.path.exists(workdir)


@pytest.mark.parametrize(
    "sig,when",
    [
        (signal.SIGTERM, "streaming "),
        (signal.SIGHUP, "streaming "),
        (signal.SIGINT, "streaming "),
        (signal.SIGTERM, "engine pid"),
    ],
    ids=["term", "hup", "int", "term-at-start"],
)
def test_demo_stopped_by_a_signal_cleans_up(sig: signal.Signals, when: str) -> None:
    proc = _demo("--requests", "2", "--max-new-tokens", "200")
    out = _until_streaming(proc, when)
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    assert len(pids) == 2 and all(_alive(p) for p in pids), out
    workdir = re.search(r"on unix:(/tmp/hisparse-demo-[^/]+)/", out).group(1)
    prefix = f"hisparse-demo{proc.pid}-"
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    out += rest
    assert proc.returncode == 128 + sig, out
    assert f"demo stopped by {sig.name}" in out and "Traceback" not in out, out
    assert not any(_alive(p) for p in pids), out
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
    assert not os.path.exists(workdir)


def test_children_of_a_killed_demo_stop_too() -> None:
    """SIGKILL leaves the demo no chance to clean up: the parent-death signal stops its
    children, and the service removes its own segment files on the way out."""
    proc = _demo("--requests", "1", "--max-new-tokens", "200")
    out = _until_streaming(proc)
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    workdir = re.search(r"on unix:(/tmp/hisparse-demo-[^/]+)/", out).group(1)
    exits = [os.pidfd_open(p) for p in pids]  # readable once the process has exited
    try:
        proc.kill()
        proc.communicate(timeout=30)
        for pid, fd in zip(pids, exits):
            readable, _, _ = select.select([fd], [], [], 60)
            assert readable, f"child {pid} still runs after its parent was killed"
        prefix = f"hisparse-demo{proc.pid}-"
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
    finally:
        for pid, fd in zip(pids, exits):
            if _alive(pid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
